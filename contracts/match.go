package contracts

import (
	"regexp"
	"strings"
)

// The patterns every request meets (IDs, tenants, pools, durations,
// paths) are matched by hand: Go's regexp took ~10 % of a strict
// decode, a dozen matches per job request, each run twice (the schema's
// check, then Validate's). Each function here accepts exactly what its
// pattern does, byte for byte (TestMatchersAgreeWithPatterns,
// FuzzMatchersAgreeWithPatterns); patterns without one stay regexps.

// matcher returns the function that matches pattern: a hand-written one
// where there is one, else the compiled expression's.
func matcher(pattern string) (func(string) bool, error) {
	if m, ok := handMatchers[pattern]; ok {
		return m, nil
	}
	re, err := regexp.Compile(pattern)
	if err != nil {
		return nil, err
	}
	return re.MatchString, nil
}

const (
	tenantPattern = `^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$`
	poolPattern   = `^[a-z0-9]([a-z0-9-]{0,46}[a-z0-9])?$`
)

// handMatchers are the hand-written matchers by pattern.
var handMatchers = map[string]func(string) bool{
	idPattern:                      isID,
	tenantPattern:                  isTenant,
	optionalPattern(tenantPattern): func(s string) bool { return s == "" || isTenant(s) },
	poolPattern:                    isPool,
	optionalPattern(poolPattern):   func(s string) bool { return s == "" || isPool(s) },
	durationPattern:                isDurationText,
	cleanPathPattern:               isCleanPath,
	"^(/|" + cleanPathPattern[1:len(cleanPathPattern)-1] + ")?$": func(s string) bool {
		return s == "" || s == "/" || isCleanPath(s)
	},
}

func alnum(c byte) bool { return 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' }

func lowerAlnum(c byte) bool { return 'a' <= c && c <= 'z' || '0' <= c && c <= '9' }

// isID is idPattern: 1-128 of [A-Za-z0-9_-], the first a letter or digit.
func isID(s string) bool {
	if len(s) == 0 || len(s) > 128 || !alnum(s[0]) {
		return false
	}
	for i := 1; i < len(s); i++ {
		if c := s[i]; !alnum(c) && c != '_' && c != '-' {
			return false
		}
	}
	return true
}

// dnsLabel is [a-z0-9]([a-z0-9-]{0,max-2}[a-z0-9])?: 1-max of [a-z0-9-],
// neither end a dash.
func dnsLabel(s string, max int) bool {
	if len(s) == 0 || len(s) > max || s[0] == '-' || s[len(s)-1] == '-' {
		return false
	}
	for i := 0; i < len(s); i++ {
		if c := s[i]; !lowerAlnum(c) && c != '-' {
			return false
		}
	}
	return true
}

func isTenant(s string) bool { return dnsLabel(s, 32) }

func isPool(s string) bool { return dnsLabel(s, 48) }

// isDurationText is durationPattern: "0", or one or more of a number
// (digits with an optional fraction, or a fraction alone) and a unit.
func isDurationText(s string) bool {
	if s == "0" {
		return true
	}
	if s == "" {
		return false
	}
	for s != "" {
		// The number: [0-9]+(\.[0-9]*)? or \.[0-9]+.
		i := 0
		for i < len(s) && '0' <= s[i] && s[i] <= '9' {
			i++
		}
		whole := i > 0
		if i < len(s) && s[i] == '.' {
			i++
			j := i
			for i < len(s) && '0' <= s[i] && s[i] <= '9' {
				i++
			}
			if !whole && i == j {
				return false
			}
		} else if !whole {
			return false
		}
		s = s[i:]
		// The unit. "ms" before "m": an "s" after "m" could start no
		// number, so "m" then "s" never matches where "ms" fails.
		switch {
		case strings.HasPrefix(s, "ns"), strings.HasPrefix(s, "us"), strings.HasPrefix(s, "ms"):
			s = s[2:]
		case strings.HasPrefix(s, "µs"), strings.HasPrefix(s, "μs"):
			s = s[len("µs"):] // both mu are two bytes
		case strings.HasPrefix(s, "s"), strings.HasPrefix(s, "m"), strings.HasPrefix(s, "h"):
			s = s[1:]
		default:
			return false
		}
	}
	return true
}

// isCleanPath is cleanPathPattern: one or more elements, each a slash
// and a non-empty name with no slash or NUL that is not "." or "..".
func isCleanPath(s string) bool {
	if len(s) < 2 || s[0] != '/' {
		return false
	}
	for s != "" {
		s = s[1:] // the slash
		end := strings.IndexByte(s, '/')
		if end < 0 {
			end = len(s)
		}
		name := s[:end]
		if name == "" || name == "." || name == ".." || strings.IndexByte(name, 0) >= 0 {
			return false
		}
		s = s[end:]
	}
	return true
}
