package freeport

var EphemeralStart = ephemeralStart
