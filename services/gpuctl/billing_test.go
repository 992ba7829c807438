package gpuctl

import (
	"context"
	"encoding/csv"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpuplane/gpuplane/contracts"
)

func TestPricesGetAndSet(t *testing.T) {
	h := start(t)
	dir := t.TempDir()
	from := time.Now().Add(time.Hour).UTC().Truncate(time.Second).Format(time.RFC3339)
	book := filepath.Join(dir, "book.yaml")
	if err := os.WriteFile(book, []byte(fmt.Sprintf(`
versions:
  - id: v1
    effectiveFrom: %s
    currency: USD
    gpu:
      H100-80GB: {onDemand: 4.25, spot: "1.70", reserved: 2.5}
      "*": {onDemand: 1}
    cpuCoreHour: 0.04
`, from)), 0o644); err != nil {
		t.Fatal(err)
	}
	code, out, errOut := h.run("prices", "set", "-f", book)
	if code != ExitOK || !strings.Contains(out, "price book revision 1, 1 versions") || !strings.Contains(out, "4.25") ||
		!strings.Contains(out, "1.70") {
		t.Fatalf("prices set: %d %q %q", code, out, errOut)
	}
	code, out, _ = h.run("prices", "get", "-o", "json")
	var doc contracts.PriceBookDoc
	if code != ExitOK || json.Unmarshal([]byte(out), &doc) != nil || doc.Book.Versions[0].GPU["H100-80GB"].OnDemand != 4_250_000 ||
		doc.Book.Versions[0].CPUCoreHour != 40_000 {
		t.Errorf("prices get -o json: %d %s", code, out)
	}
	// Refused before sending, with the field.
	bad := filepath.Join(dir, "bad.yaml")
	_ = os.WriteFile(bad, []byte("versions:\n  - id: v2\n    effectiveFrom: 2099-01-01T00:00:00Z\n    currency: USD\n    gpu: {B300: {onDemand: 1}}\n"), 0o644)
	if code, _, errOut := h.run("prices", "set", "-f", bad); code != ExitError || !strings.Contains(errOut, "versions[0].gpu.B300: unknown_gpu_model") ||
		!strings.Contains(errOut, "checked before sending") {
		t.Errorf("bad book: %d %q", code, errOut)
	}
	// Refused by the gateway: reaching back.
	past := filepath.Join(dir, "past.json")
	_ = os.WriteFile(past, []byte(`{"versions":[{"id":"v0","effectiveFrom":"2020-01-01T00:00:00Z","currency":"USD","gpu":{"*":{"onDemand":"1"}}}]}`), 0o644)
	if code, _, errOut := h.run("prices", "set", "-f", past); code != ExitError || !strings.Contains(errOut, "effective_in_past") {
		t.Errorf("past book: %d %q", code, errOut)
	}
	if code, _, errOut := h.run("prices", "set", "-f", book, "--revision", "99"); code != ExitError || !strings.Contains(errOut, "conflict") {
		t.Errorf("stale revision: %d %q", code, errOut)
	}
	if code, _, _ := h.run("prices", "list"); code != ExitUsage {
		t.Errorf("prices list: %d", code)
	}
	// "now" and "+DURATION" take effect from the moment of the command.
	rel := filepath.Join(dir, "relative.yaml")
	_ = os.WriteFile(rel, []byte(fmt.Sprintf(`
versions:
  - {id: v1, effectiveFrom: %q, currency: USD, gpu: {H100-80GB: {onDemand: 4.25, spot: "1.70", reserved: 2.5}, "*": {onDemand: 1}}, cpuCoreHour: 0.04}
  - {id: v2, effectiveFrom: +2h, currency: USD, gpu: {"*": {onDemand: 2}}}
`, from)), 0o644)
	code, out, errOut = h.run("prices", "set", "-f", rel, "-o", "json")
	if code != ExitOK || json.Unmarshal([]byte(out), &doc) != nil || len(doc.Book.Versions) != 2 ||
		doc.Book.Versions[1].EffectiveFrom.Sub(time.Now()) < 2*time.Hour {
		t.Errorf("+2h: %d %q %q", code, out, errOut)
	}
	if _, err := resolveEffective([]byte(`{"versions":[{"effectiveFrom":"+soon"}]}`), time.Now()); err == nil {
		t.Error("+soon accepted")
	}
}

func TestBudgetCommands(t *testing.T) {
	h := start(t)
	if code, out, _ := h.run("budget", "get", "--tenant", "acme"); code != ExitOK || !strings.Contains(out, "tenant acme has no budget") {
		t.Errorf("get: %d %q", code, out)
	}
	if code, _, errOut := h.run("budget", "set", "--tenant", "acme", "--limit", "ten"); code != ExitError || !strings.Contains(errOut, "limit") {
		t.Errorf("bad limit: %d %q", code, errOut)
	}
	code, out, errOut := h.run("budget", "set", "--tenant", "acme", "--limit", "250", "--period", "daily", "--policy", "spot-only")
	if code != ExitOK || !strings.Contains(out, "tenant acme: daily budget of 250.00, policy spot-only") {
		t.Fatalf("set: %d %q %q", code, out, errOut)
	}
	if code, out, _ := h.run("budget", "delete", "--tenant", "acme"); code != ExitOK || !strings.Contains(out, "no budget") {
		t.Errorf("delete: %d %q", code, out)
	}
}

func TestInvoiceAndUsageFormats(t *testing.T) {
	h := start(t)
	day := time.Date(2026, 11, 3, 0, 0, 0, 0, time.UTC)
	for i, r := range []struct {
		class          contracts.PriceClass
		pool           string
		cost, onDemand int64
	}{{contracts.PriceOnDemand, "h100", 8_500_000, 8_500_000}, {contracts.PriceSpot, "l4", 1_234_567, 3_000_000}} {
		id := contracts.AllocationID("acme", fmt.Sprintf("j%d", i), 1)
		rec := contracts.UsageRecord{SchemaVersion: 1, ID: contracts.UsageSegmentID(id, 0), AllocationID: id, Tenant: "acme",
			JobID: fmt.Sprintf("j%d", i), Attempt: 1, NodeID: "n", Pool: r.pool, GPUModel: "H100-80GB", GPUs: 2, Start: day,
			End: day.Add(time.Hour), GPUMillis: 7_200_000, GPUSeconds: 7200, Time: day.Add(time.Hour),
			UsageSegment: contracts.UsageSegment{Final: true, Seconds: 3600, GPUShare: "2", PriceClass: r.class, PriceVersion: "v1",
				Currency: "USD", CostMicros: r.cost, OnDemandCostMicros: r.onDemand}}
		if _, err := h.bus.Publish(context.Background(), contracts.SubjectUsage("acme"), rec.ID, rec); err != nil {
			t.Fatal(err)
		}
	}
	h.eventually("the invoice", func() bool {
		_, out, _ := h.run("invoice", "--tenant", "acme", "--period", "2026-11")
		return strings.Contains(out, "total 9.73 USD (at on-demand rates 11.50; spot saved 1.77)")
	})
	code, out, _ := h.run("invoice", "--tenant", "acme", "--period", "2026-11", "-o", "csv")
	rows, err := csv.NewReader(strings.NewReader(out)).ReadAll()
	if code != ExitOK || err != nil || len(rows) != 1+2+2+1 {
		t.Fatalf("invoice csv: %d %v %q", code, err, out)
	}
	if total := rows[len(rows)-1]; total[2] != "total" || total[10] != "9.734567" || total[12] != "1.765433" {
		t.Errorf("csv total row %v: exact micro-units expected", total)
	}
	code, out, _ = h.run("usage", "--tenant", "acme", "-o", "csv")
	if rows, err := csv.NewReader(strings.NewReader(out)).ReadAll(); code != ExitOK || err != nil || len(rows) != 3 || rows[2][17] != "1.234567" {
		t.Errorf("usage csv: %d %v %q", code, err, out)
	}
	if code, out, _ := h.run("usage", "--tenant", "acme"); code != ExitOK || !strings.Contains(out, "cost 9.73 USD") ||
		!strings.Contains(out, "l4 (spot)") || !strings.Contains(out, "2026-11-03") {
		t.Errorf("usage: %d %q", code, out)
	}
	if code, _, errOut := h.run("list", "-o", "csv"); code != ExitUsage || !strings.Contains(errOut, "csv is for usage and invoice") {
		t.Errorf("list -o csv: %d %q", code, errOut)
	}
	if code, _, errOut := h.run("invoice", "--period", "November"); code != ExitUsage || !strings.Contains(errOut, "invalid_period") {
		t.Errorf("bad period: %d %q", code, errOut)
	}
}

// TestExampleBookIsValid keeps the tour's price book valid.
func TestExampleBookIsValid(t *testing.T) {
	data, err := readRequestFile("../../deploy/pricebook/example.yaml")
	if err != nil {
		t.Fatal(err)
	}
	if data, err = resolveEffective(data, time.Now()); err != nil {
		t.Fatal(err)
	}
	if _, err := contracts.DecodePriceBook(data); err != nil {
		t.Fatal(err)
	}
}
