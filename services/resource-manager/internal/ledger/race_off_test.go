//go:build !race

package ledger

// raceEnabled reports a -race build (see race_on_test.go).
const raceEnabled = false
