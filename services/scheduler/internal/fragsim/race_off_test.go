//go:build !race

package fragsim

const raceEnabled = false
