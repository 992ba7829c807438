package contracts

import (
	"math/rand/v2"
	"regexp"
	"strings"
	"testing"
)

// matchAlphabet spans every class the hand-matched patterns tell apart:
// each kind of letter and digit, the separators they allow or refuse,
// the duration units' letters and both mu, NUL, a space, a byte that is
// not UTF-8 and a multi-byte letter.
var matchAlphabet = []string{"a", "z", "A", "Z", "0", "9", "5", "-", "_", ".", "/", "\x00", " ", "\xff", "é",
	"n", "u", "m", "s", "h", "µ", "μ", "ms", "..", "1.5", "/.", "/..", "*"}

// handPatterns are the patterns with a hand-written matcher.
func handPatterns() []string {
	var out []string
	for p := range handMatchers {
		out = append(out, p)
	}
	return out
}

// TestMatchersAgreeWithPatterns: each hand-written matcher answers as
// its regexp for hundreds of thousands of strings built of the classes
// the pattern tells apart, of every length around its bounds, and for
// the cases written out below.
func TestMatchersAgreeWithPatterns(t *testing.T) {
	written := []string{"", "0", "00", "1s", "1.5h", ".5m", "5.m", ".m", "1ms", "1m5s", "1mss", "1us", "1µs", "1μs", "1ns",
		"1h2m3s4ms5us6ns", "1", "s", "1.5.5s", "-1s", "+1s", "1e3s", "/", "//", "/a", "/a/", "/.", "/..", "/...", "/.a",
		"/..a", "/a/./b", "/a/../b", "/a\x00b", "/\xff", "a", "a-", "-a", "a-b", "A", "a_b", "_a", strings.Repeat("a", 32),
		strings.Repeat("a", 33), strings.Repeat("a", 48), strings.Repeat("a", 49), strings.Repeat("a", 128),
		strings.Repeat("a", 129), "a" + strings.Repeat("-", 30) + "b", "*"}
	rng := rand.New(rand.NewPCG(17, 23))
	for _, p := range handPatterns() {
		re := regexp.MustCompile(p)
		hand, err := matcher(p)
		if err != nil {
			t.Fatal(err)
		}
		matched := 0
		check := func(s string) {
			if got, want := hand(s), re.MatchString(s); got != want {
				t.Errorf("pattern %s, %q: hand %v, regexp %v", p, s, got, want)
			} else if got {
				matched++
			}
		}
		for _, s := range written {
			check(s)
		}
		for range 40_000 {
			var b strings.Builder
			n := rng.IntN(12)
			if rng.IntN(8) == 0 { // around the length bounds
				n = 28 + rng.IntN(104)
			}
			for range n {
				if rng.IntN(3) == 0 { // mostly what the pattern allows
					b.WriteString(matchAlphabet[rng.IntN(len(matchAlphabet))])
				} else {
					b.WriteString(matchAlphabet[rng.IntN(7)])
				}
			}
			check(b.String())
		}
		if matched < 100 {
			t.Errorf("pattern %s: only %d strings matched: the test reaches too little of it", p, matched)
		}
	}
}

// FuzzMatchersAgreeWithPatterns: the same for any string.
func FuzzMatchersAgreeWithPatterns(f *testing.F) {
	for _, s := range []string{"job-1", "acme", "1h30m", "0.5s", "1µs", "/data/x", "/a/../b", "a-b-c"} {
		f.Add(s)
	}
	res := map[string]*regexp.Regexp{}
	for _, p := range handPatterns() {
		res[p] = regexp.MustCompile(p)
	}
	f.Fuzz(func(t *testing.T, s string) {
		for p, re := range res {
			if got, want := handMatchers[p](s), re.MatchString(s); got != want {
				t.Fatalf("pattern %s, %q: hand %v, regexp %v", p, s, got, want)
			}
		}
	})
}

// TestPublishedPatternsHaveMatchers: the patterns requests meet most are
// matched by hand; a pattern renamed in the schema rules without its
// matcher would silently fall back to a regexp (still correct, slower).
func TestPublishedPatternsHaveMatchers(t *testing.T) {
	s := schemaFor(JobRequest{})
	for _, path := range [][]string{{"id"}, {"tenant"}, {"pool"}, {"placementTimeout"}, {"run", "workingDir"}} {
		n := s
		for _, k := range path {
			n = n.Properties[k]
			if n == nil {
				t.Fatalf("no schema at %v", path)
			}
		}
		if _, ok := handMatchers[n.Pattern]; !ok {
			t.Errorf("%v: pattern %s has no hand matcher", path, n.Pattern)
		}
	}
}
