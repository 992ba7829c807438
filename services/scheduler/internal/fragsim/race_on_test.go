//go:build race

package fragsim

// raceEnabled reports a -race build: full-trace replays run ten times
// slower under it.
const raceEnabled = true
