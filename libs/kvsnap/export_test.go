package kvsnap

// ReadIndex is readIndex for the tests: the payload parts a head names.
var ReadIndex = Store.readIndex
