//go:build race

package state

// raceEnabled reports a -race build: the randomized tests run fewer seeds
// under it (each is several times slower, and the race detector's value
// is in the interleavings, not the seed count).
const raceEnabled = true
