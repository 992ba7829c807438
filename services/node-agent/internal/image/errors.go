package image

import (
	"context"
	"errors"
	"fmt"
	"net/http"

	"github.com/google/go-containerregistry/pkg/v1/remote/transport"
)

// The errors of Acquire, matched with errors.Is; each maps to one reason of
// a failed attempt (contracts: image_invalid, image_not_found,
// image_unauthorized, image_pull_failed). The wrapped message carries the
// registry's own words where it gave any, never credentials.
var (
	// ErrInvalidReference: the reference does not parse (image_invalid).
	ErrInvalidReference = errors.New("invalid image reference")
	// ErrNotFound: the registry has no such repository, tag or digest, or
	// no variant of the image for this machine's platform (image_not_found).
	ErrNotFound = errors.New("image not found")
	// ErrUnauthorized: the registry refused the credentials, or asked for
	// some and had none (image_unauthorized).
	ErrUnauthorized = errors.New("image unauthorized")
	// ErrPullFailed: anything else, from an unreachable registry to a layer
	// that does not unpack (image_pull_failed).
	ErrPullFailed = errors.New("image pull failed")
)

// classify wraps a go-containerregistry error in the error its registry
// answer means. A context error stays itself (the caller gave up; nothing
// is wrong with the image).
func classify(ref string, err error) error {
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		return err
	}
	for _, known := range []error{ErrInvalidReference, ErrNotFound, ErrUnauthorized, ErrPullFailed} {
		if errors.Is(err, known) {
			return err
		}
	}
	var te *transport.Error
	if errors.As(err, &te) {
		switch {
		case te.StatusCode == http.StatusUnauthorized || te.StatusCode == http.StatusForbidden ||
			hasCode(te, transport.UnauthorizedErrorCode, transport.DeniedErrorCode):
			return fmt.Errorf("%w: %s: %s", ErrUnauthorized, ref, te.Error())
		case te.StatusCode == http.StatusNotFound ||
			hasCode(te, transport.ManifestUnknownErrorCode, transport.NameUnknownErrorCode, transport.BlobUnknownErrorCode):
			return fmt.Errorf("%w: %s: %s", ErrNotFound, ref, te.Error())
		}
	}
	return fmt.Errorf("%w: %s: %v", ErrPullFailed, ref, err)
}

func hasCode(te *transport.Error, codes ...transport.ErrorCode) bool {
	for _, d := range te.Errors {
		for _, c := range codes {
			if d.Code == c {
				return true
			}
		}
	}
	return false
}

// answered reports whether err is the registry's answer (an HTTP status)
// rather than no answer at all: a refusal is never overridden by the
// cache, an unreachable registry may be.
func answered(err error) bool {
	var te *transport.Error
	return errors.As(err, &te)
}
