package gateway

import (
	"crypto/rand"
	"encoding/binary"
	"time"
)

// crockford is Crockford's base32 alphabet (no I, L, O, U), as in ULIDs.
const crockford = "0123456789ABCDEFGHJKMNPQRSTVWXYZ"

// newJobID returns a ULID-style job ID for a request that came without
// one: 48 bits of Unix milliseconds then 80 random bits, as 26 Crockford
// base32 characters. IDs sort by creation time and always pass
// contracts.ValidateID.
func newJobID(now time.Time) string {
	var b [16]byte
	binary.BigEndian.PutUint64(b[:8], uint64(now.UnixMilli())<<16)
	_, _ = rand.Read(b[6:]) // crypto/rand.Read never fails (Go 1.24+)
	hi, lo := binary.BigEndian.Uint64(b[:8]), binary.BigEndian.Uint64(b[8:])
	var out [26]byte
	for i := len(out) - 1; i >= 0; i-- {
		out[i] = crockford[lo&31]
		lo = lo>>5 | hi<<59
		hi >>= 5
	}
	return string(out[:])
}
