package gateway

import (
	"crypto/tls"
	"fmt"
	"os"
	"sync"
	"time"
)

// keyPair loads a certificate and key, and again when either file changed.
type keyPair struct {
	cert, key string

	mu       sync.Mutex
	loaded   *tls.Certificate
	modified time.Time
}

func (k *keyPair) get(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	var newest time.Time
	for _, f := range []string{k.cert, k.key} {
		st, err := os.Stat(f)
		if err != nil {
			if k.loaded != nil {
				return k.loaded, nil // keep serving the last good pair
			}
			return nil, fmt.Errorf("tls: %w", err)
		}
		if st.ModTime().After(newest) {
			newest = st.ModTime()
		}
	}
	if k.loaded != nil && !newest.After(k.modified) {
		return k.loaded, nil
	}
	c, err := tls.LoadX509KeyPair(k.cert, k.key)
	if err != nil {
		if k.loaded != nil {
			return k.loaded, nil
		}
		return nil, fmt.Errorf("tls: key pair %s, %s: %w", k.cert, k.key, err)
	}
	k.loaded, k.modified = &c, newest
	return k.loaded, nil
}
