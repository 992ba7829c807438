package contracts

import "github.com/oklog/ulid/v2"

// NewJobID returns an ID for a job whose client did not choose one: a ULID
// (26 Crockford base32 characters, time-ordered, 80 random bits), which
// always passes ValidateID. The gateway and gpuctl both use it, so IDs look
// the same whichever entry point made them.
func NewJobID() string { return ulid.Make().String() }
