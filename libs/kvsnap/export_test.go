package kvsnap

import "context"

// ReadIndex is readIndex for the tests: the payload parts a head names.
func ReadIndex(s Store, ctx context.Context, h Head) ([]Part, error) { return s.readIndex(ctx, h, nil) }
