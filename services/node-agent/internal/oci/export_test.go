package oci

// SetOverlay makes CreateBundle try overlayfs or not (the read-only
// fallback); it returns the undo.
func SetOverlay(on bool) func() {
	old := tryOverlay
	tryOverlay = on
	return func() { tryOverlay = old }
}

// FakeMachine is fakeMachine for the container tests.
var FakeMachine = fakeMachine
