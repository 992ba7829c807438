//go:build race

package ledger

// raceEnabled reports a -race build: the model test, one goroutine with
// nothing for the detector to find, runs fifteen times slower under it.
const raceEnabled = true
