package console

import (
	"strings"
	"testing"
)

// TestConsoleAnswersAtRoot: the gateway's / is a page a browser renders,
// whose scripts run without an error, and that asks for a login before
// it shows anything of the platform.
func TestConsoleAnswersAtRoot(t *testing.T) {
	s := needStack(t)
	b := s.open(t, desktopWidth, 900)
	b.navigate("/")
	b.until("the page renders text", "document.body && document.body.innerText.trim().length > 0")
	if txt := b.text(); strings.Contains(txt, "h100-01") {
		t.Errorf("the console shows the fleet before a login:\n%s", clip(txt, 2000))
	}
	b.shot("root")
}
