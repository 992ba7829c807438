package contracts

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"reflect"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/nats-io/nats.go/jetstream"
)

// Billing's shared vocabulary: the price book and the budgets (KV buckets
// edited by administrators), the budget status billing publishes for the
// scheduler, and the budget alerts. The usage record is in ops.go, the
// invoice in invoice.go. services/billing/README.md tells how they are
// used, with the rounding rules.

// KV buckets and keys.
const (
	// BucketPriceBook holds the price book under KeyPriceBook (written by
	// administrators through the gateway or gpuctl, compare-and-set on the
	// revision) and billing's metering watermark under KeyMeteredUntil
	// (written by billing only).
	BucketPriceBook = "gp-pricebook"
	KeyPriceBook    = "book"
	KeyMeteredUntil = "metered-until"
	// BucketBudgets holds one Budget per tenant, the key is the tenant.
	BucketBudgets = "gp-budgets"
	// BucketBudgetStatus holds one BudgetStatus per tenant with a budget,
	// the key is the tenant; billing is its single writer, the
	// scheduler's intake reads it.
	BucketBudgetStatus = "gp-budget-status"
)

// KeyValues returns the configuration of the platform's KV buckets. Like
// Streams, each service that uses a bucket creates or updates it at start.
func KeyValues(o StreamOptions) []jetstream.KeyValueConfig {
	if o.Replicas <= 0 {
		o.Replicas = 1
	}
	storage := jetstream.FileStorage
	if o.Memory {
		storage = jetstream.MemoryStorage
	}
	kv := func(bucket, desc string, history uint8) jetstream.KeyValueConfig {
		return jetstream.KeyValueConfig{Bucket: bucket, Description: desc, History: history,
			Storage: storage, Replicas: o.Replicas, MaxValueSize: MaxMessageBytes}
	}
	return []jetstream.KeyValueConfig{
		// The book's history is its audit trail: every accepted edit.
		kv(BucketPriceBook, "price book (versions with effective dates) and billing's metering watermark", 64),
		kv(BucketBudgets, "budget per tenant", 16),
		kv(BucketBudgetStatus, "budget status per tenant, published by billing", 1),
		// Leases are written by compare-and-set only; one value per key is
		// all a reader needs (the epoch lives in the value).
		kv(BucketLeases, "leader leases with fencing epochs", 1),
		kv(BucketSnapshots, "services' snapshots of their log of record (chunks and a head)", 1),
		kv(BucketQuotas, "quota and fair-share weight per tenant", 16),
		kv(BucketPools, "placement policy per pool", 16),
		kv(BucketNodeAdmin, "cordon and drain per node", 16),
		// Identity (identity.go): written by the gateway's identity endpoints.
		kv(BucketRoleBindings, "role bindings per subject", 16),
		kv(BucketAPITokens, "API and session tokens (hashes only)", 1),
		kv(BucketQuotaGrants, "quota each tenant was granted by a platform admin", 16),
		// Secrets: no history, so a replaced password is gone.
		kv(BucketRegistryCredentials, "registry logins per tenant (secrets: node agents read them)", 1),
	}
}

// Billing reasons.
const (
	// ReasonBudgetExceeded: a tenant at 100% of its budget under the
	// reject policy (or spot-only, for a request that is not spot or
	// best-effort) submitted a job.
	ReasonBudgetExceeded Reason = "budget_exceeded"
	// ReasonEffectiveInPast: a price version would take effect before
	// time that is already metered (or before now).
	ReasonEffectiveInPast Reason = "effective_in_past"
	// ReasonImmutableVersion: an edit changes or removes a price version
	// already in effect.
	ReasonImmutableVersion Reason = "immutable_version"
	// ReasonConflict: the document changed since it was read (a
	// compare-and-set lost); read it again and retry.
	ReasonConflict Reason = "conflict"
	// ReasonInvalidPeriod: a period is not YYYY-MM or YYYY-MM-DD.
	ReasonInvalidPeriod Reason = "invalid_period"
)

// PriceClass is how a machine is bought: it decides which GPU price
// applies. A node announces it in NodeInventory.PriceClass.
type PriceClass string

const (
	PriceOnDemand PriceClass = "on-demand"
	PriceSpot     PriceClass = "spot"
	PriceReserved PriceClass = "reserved"
)

// PriceClasses lists the classes, on-demand first.
var PriceClasses = []PriceClass{PriceOnDemand, PriceSpot, PriceReserved}

// PriceClassOf reads a node's announced class; empty or unknown is
// on-demand (the price nobody gets a discount on).
func PriceClassOf(s string) PriceClass {
	if c := PriceClass(s); slices.Contains(PriceClasses, c) {
		return c
	}
	return PriceOnDemand
}

// AnyGPUModel prices, in a PriceVersion, every model it does not list.
const AnyGPUModel = "*"

// PriceBook is every price version, oldest first. A version is in effect
// from its EffectiveFrom until the next version's: the versions partition
// time, and a run segment is priced by the version in effect over it
// (billing splits segments at every EffectiveFrom).
type PriceBook struct {
	SchemaVersion int            `json:"schemaVersion,omitempty"`
	Versions      []PriceVersion `json:"versions"`
}

// PriceVersion is one complete price list.
type PriceVersion struct {
	// ID names the version in usage records ("2026-11", "v7").
	ID string `json:"id" jsonschema:"pattern=^[A-Za-z0-9][A-Za-z0-9_-]{0\\,127}$"`
	// EffectiveFrom is a whole second, UTC or with an offset.
	EffectiveFrom time.Time `json:"effectiveFrom"`
	// Currency is an ISO 4217 code; every version of a book has the same.
	Currency string `json:"currency" jsonschema:"pattern=^[A-Z]{3}$"`
	// GPU prices one whole GPU for one hour, by GPU model (a GPUModels
	// identifier, or "*" for every model not listed). A MIG instance or a
	// fraction of a GPU pays its share of its card's price.
	GPU map[string]GPUPrices `json:"gpu"`
	// CPUCoreHour and MemoryGiBHour, when set, price the CPU cores and
	// host memory a job requested, for as long as it ran.
	CPUCoreHour   Money  `json:"cpuCoreHour,omitempty"`
	MemoryGiBHour Money  `json:"memoryGiBHour,omitempty"`
	Note          string `json:"note,omitempty"`
}

// GPUPrices is the price of one GPU-hour of a model in each class. Spot
// and Reserved, when zero or absent, fall back to OnDemand.
type GPUPrices struct {
	OnDemand Money `json:"onDemand"`
	Spot     Money `json:"spot,omitempty"`
	Reserved Money `json:"reserved,omitempty"`
}

// Price returns the GPU-hour price of class.
func (p GPUPrices) Price(c PriceClass) Money {
	switch {
	case c == PriceSpot && p.Spot > 0:
		return p.Spot
	case c == PriceReserved && p.Reserved > 0:
		return p.Reserved
	}
	return p.OnDemand
}

// GPUPrice returns the GPU-hour price of model in class, and false when
// the version prices neither the model nor "*".
func (v PriceVersion) GPUPrice(model string, c PriceClass) (Money, bool) {
	p, ok := v.GPU[model]
	if !ok {
		p, ok = v.GPU[AnyGPUModel]
	}
	if !ok {
		return 0, false
	}
	return p.Price(c), true
}

// At returns the version in effect at t, false before the first one.
func (b PriceBook) At(t time.Time) (PriceVersion, bool) {
	i := versionAt(b.Versions, t)
	if i < 0 {
		return PriceVersion{}, false
	}
	return b.Versions[i], true
}

// versionAt returns the index of the last version effective at or before t.
func versionAt(vs []PriceVersion, t time.Time) int {
	i := -1
	for j, v := range vs {
		if v.EffectiveFrom.After(t) {
			break
		}
		i = j
	}
	return i
}

// Changes returns the EffectiveFrom instants strictly inside (from, to):
// where a segment over [from, to) must be split.
func (b PriceBook) Changes(from, to time.Time) []time.Time {
	var out []time.Time
	for _, v := range b.Versions {
		if v.EffectiveFrom.After(from) && v.EffectiveFrom.Before(to) {
			out = append(out, v.EffectiveFrom)
		}
	}
	return out
}

// Currency is the currency of the book ("" when it has no version).
func (b PriceBook) Currency() string {
	if len(b.Versions) == 0 {
		return ""
	}
	return b.Versions[0].Currency
}

var currencyRE = regexp.MustCompile(`^[A-Z]{3}$`)

// MaxPriceVersions bounds a book, so that it always fits one KV value.
const MaxPriceVersions = 200

// maxHourlyPrice bounds a price per GPU-hour, CPU core-hour or GiB-hour.
const maxHourlyPrice = Money(100_000 * MicrosPerUnit)

// Validate checks the book on its own: every problem at once, each with
// its field path ("versions[1].gpu.H100-80GB.spot").
func (b PriceBook) Validate() error {
	var errs []FieldError
	add := func(field string, reason Reason, format string, args ...any) {
		errs = append(errs, FieldError{Field: field, Reason: reason, Message: fmt.Sprintf(format, args...)})
	}
	if b.SchemaVersion != 0 && b.SchemaVersion != SchemaVersion {
		add("schemaVersion", ReasonUnsupportedSchema, "schema version %d is not supported; this server speaks %d", b.SchemaVersion, SchemaVersion)
	}
	if len(b.Versions) > MaxPriceVersions {
		add("versions", ReasonOutOfRange, "%d versions, limit is %d", len(b.Versions), MaxPriceVersions)
	}
	ids := map[string]int{}
	for i, v := range b.Versions {
		at := fmt.Sprintf("versions[%d]", i)
		switch {
		case v.ID == "":
			add(at+".id", ReasonMissingField, "every version needs an id")
		case ValidateID(v.ID) != nil:
			add(at+".id", ReasonInvalidID, "%v", ValidateID(v.ID))
		default:
			if j, dup := ids[v.ID]; dup {
				add(at+".id", ReasonInvalidValue, "id %q is also versions[%d]'s", v.ID, j)
			}
			ids[v.ID] = i
		}
		switch {
		case v.EffectiveFrom.IsZero():
			add(at+".effectiveFrom", ReasonMissingField, "every version needs an effectiveFrom (RFC 3339)")
		case v.EffectiveFrom.Nanosecond() != 0:
			add(at+".effectiveFrom", ReasonInvalidValue, "%s is not a whole second: usage is metered in whole seconds", v.EffectiveFrom.Format(time.RFC3339Nano))
		case i > 0 && !v.EffectiveFrom.After(b.Versions[i-1].EffectiveFrom):
			add(at+".effectiveFrom", ReasonInvalidValue, "%s is not after versions[%d]'s %s: list versions oldest first, one per instant",
				v.EffectiveFrom.UTC().Format(time.RFC3339), i-1, b.Versions[i-1].EffectiveFrom.UTC().Format(time.RFC3339))
		}
		switch {
		case !currencyRE.MatchString(v.Currency):
			add(at+".currency", ReasonInvalidValue, "currency %q: want an ISO 4217 code such as USD", v.Currency)
		case i > 0 && v.Currency != b.Versions[0].Currency:
			add(at+".currency", ReasonInvalidValue, "currency %s differs from versions[0]'s %s: a book has one currency", v.Currency, b.Versions[0].Currency)
		}
		if len(v.GPU) == 0 {
			add(at+".gpu", ReasonMissingField, "a version prices at least one GPU model (or \"*\")")
		}
		for _, model := range slices.Sorted(maps.Keys(v.GPU)) {
			p := v.GPU[model]
			f := at + ".gpu." + model
			if model != AnyGPUModel && !KnownGPUModel(model) {
				add(f, ReasonUnknownGPUModel, "unknown GPU model %q; want %q or one of %v", model, AnyGPUModel, GPUModels)
			}
			if p.OnDemand <= 0 {
				add(f+".onDemand", ReasonOutOfRange, "on-demand price %s; want more than 0", p.OnDemand)
			}
			for name, m := range map[string]Money{"onDemand": p.OnDemand, "spot": p.Spot, "reserved": p.Reserved} {
				if m < 0 || m > maxHourlyPrice {
					add(f+"."+name, ReasonOutOfRange, "price %s per GPU-hour; want 0 to %s", m, maxHourlyPrice)
				}
			}
		}
		for name, m := range map[string]Money{"cpuCoreHour": v.CPUCoreHour, "memoryGiBHour": v.MemoryGiBHour} {
			if m < 0 || m > maxHourlyPrice {
				add(at+"."+name, ReasonOutOfRange, "price %s; want 0 to %s", m, maxHourlyPrice)
			}
		}
		if len(v.Note) > MaxNameLength {
			add(at+".note", ReasonOutOfRange, "note is %d bytes, limit is %d", len(v.Note), MaxNameLength)
		}
	}
	sortFieldErrors(errs)
	return newValidationError(errs)
}

// ValidateChange checks that replacing old with b keeps every invoice
// reproducible: no version may take effect before cutoff (the later of
// now and the end of the usage already metered), and every version of old
// that took effect before cutoff stays, unchanged. b must be valid.
func (b PriceBook) ValidateChange(old PriceBook, cutoff time.Time) error {
	var errs []FieldError
	cut := cutoff.UTC().Format(time.RFC3339)
	kept := map[string]PriceVersion{}
	for _, v := range b.Versions {
		kept[v.ID] = v
	}
	for _, o := range old.Versions {
		if !o.EffectiveFrom.Before(cutoff) {
			continue
		}
		if n, ok := kept[o.ID]; !ok {
			errs = append(errs, FieldError{Field: "versions", Reason: ReasonImmutableVersion,
				Message: fmt.Sprintf("version %s (in effect since %s) is missing: a version in effect before %s can be neither removed nor changed", o.ID, o.EffectiveFrom.UTC().Format(time.RFC3339), cut)})
		} else if !samePrices(n, o) {
			errs = append(errs, FieldError{Field: "versions", Reason: ReasonImmutableVersion,
				Message: fmt.Sprintf("version %s (in effect since %s) was changed: a version in effect before %s can be neither removed nor changed; add a new version instead", o.ID, o.EffectiveFrom.UTC().Format(time.RFC3339), cut)})
		}
	}
	oldByID := map[string]PriceVersion{}
	for _, o := range old.Versions {
		oldByID[o.ID] = o
	}
	for i, v := range b.Versions {
		if o, ok := oldByID[v.ID]; ok && o.EffectiveFrom.Before(cutoff) {
			continue // unchanged, or reported above as immutable
		}
		if v.EffectiveFrom.Before(cutoff) {
			errs = append(errs, FieldError{Field: fmt.Sprintf("versions[%d].effectiveFrom", i), Reason: ReasonEffectiveInPast,
				Message: fmt.Sprintf("version %s would take effect at %s, before %s (usage up to then is metered or being metered): a price change may not reach back; use an effectiveFrom at or after %s",
					v.ID, v.EffectiveFrom.UTC().Format(time.RFC3339), cut, cut)})
		}
	}
	sortFieldErrors(errs)
	return newValidationError(errs)
}

func samePrices(a, b PriceVersion) bool {
	return a.ID == b.ID && a.EffectiveFrom.Equal(b.EffectiveFrom) && a.Currency == b.Currency &&
		reflect.DeepEqual(a.GPU, b.GPU) && a.CPUCoreHour == b.CPUCoreHour && a.MemoryGiBHour == b.MemoryGiBHour
}

func sortFieldErrors(errs []FieldError) {
	slices.SortStableFunc(errs, func(a, b FieldError) int { return strings.Compare(a.Field, b.Field) })
}

// DecodePriceBook decodes and validates a price book document (JSON, no
// unknown fields).
func DecodePriceBook(data []byte) (PriceBook, error) {
	var b PriceBook
	if err := decodeValidated(data, &b, func() error { return b.Validate() }); err != nil {
		return b, moneyFieldError(data, err)
	}
	return b, nil
}

// moneyFieldError names the amount a decoder rejected: encoding/json
// reports an Unmarshaler's error without its field, so the document is
// walked again to find the first amount that does not parse.
func moneyFieldError(data []byte, err error) error {
	ve, ok := err.(*ValidationError)
	if !ok || len(ve.Fields) != 1 || !strings.Contains(ve.Fields[0].Message, errBadMoney.Error()) {
		return err
	}
	var doc any
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if dec.Decode(&doc) != nil {
		return err
	}
	if path := badMoneyPath(doc, ""); path != "" {
		ve.Fields[0].Field = path
	}
	ve.Fields[0].Reason, ve.Reason = ReasonInvalidValue, ReasonInvalidValue
	return ve
}

// moneyKeys are the JSON names of Money fields in the billing documents.
var moneyKeys = map[string]bool{"onDemand": true, "spot": true, "reserved": true, "cpuCoreHour": true,
	"memoryGiBHour": true, "limit": true}

func badMoneyPath(v any, path string) string {
	switch x := v.(type) {
	case map[string]any:
		for _, k := range slices.Sorted(maps.Keys(x)) {
			p := strings.TrimPrefix(path+"."+k, ".")
			if moneyKeys[k] {
				raw, _ := json.Marshal(x[k])
				var m Money
				if m.UnmarshalJSON(raw) != nil {
					return p
				}
				continue
			}
			if found := badMoneyPath(x[k], p); found != "" {
				return found
			}
		}
	case []any:
		for i, e := range x {
			if found := badMoneyPath(e, fmt.Sprintf("%s[%d]", path, i)); found != "" {
				return found
			}
		}
	}
	return ""
}

// BudgetPeriod is how often a budget starts again (UTC calendar periods).
type BudgetPeriod string

const (
	BudgetMonthly BudgetPeriod = "monthly"
	BudgetDaily   BudgetPeriod = "daily"
)

// BudgetPolicy is what happens to new submissions at 100% of a budget.
type BudgetPolicy string

const (
	// PolicyNotify only alerts.
	PolicyNotify BudgetPolicy = "notify"
	// PolicyReject rejects every new job with budget_exceeded.
	PolicyReject BudgetPolicy = "reject"
	// PolicySpotOnly admits only jobs that cannot run on anything but
	// cheap capacity: priority best-effort, or a pool (JobRequest.Pool)
	// whose machines are all spot. Others are rejected with
	// budget_exceeded.
	PolicySpotOnly BudgetPolicy = "spot-only"
)

// BudgetPolicies lists the policies.
var BudgetPolicies = []BudgetPolicy{PolicyNotify, PolicyReject, PolicySpotOnly}

// BudgetThresholds are the percentages of a budget that raise an alert,
// once per period each.
var BudgetThresholds = []int{50, 80, 100}

// Budget caps a tenant's spend per period, in the price book's currency.
// It is stored in BucketBudgets under the tenant.
type Budget struct {
	SchemaVersion int          `json:"schemaVersion,omitempty"`
	Tenant        string       `json:"tenant,omitempty"`
	Period        BudgetPeriod `json:"period" jsonschema:"enum=monthly,enum=daily"`
	Limit         Money        `json:"limit"`
	Policy        BudgetPolicy `json:"policy" jsonschema:"enum=notify,enum=reject,enum=spot-only"`
}

// Validate checks a budget for tenant.
func (b Budget) Validate(tenant string) error {
	var errs []FieldError
	add := func(field string, reason Reason, format string, args ...any) {
		errs = append(errs, FieldError{Field: field, Reason: reason, Message: fmt.Sprintf(format, args...)})
	}
	if b.SchemaVersion != 0 && b.SchemaVersion != SchemaVersion {
		add("schemaVersion", ReasonUnsupportedSchema, "schema version %d is not supported", b.SchemaVersion)
	}
	if err := ValidateTenant(tenant); err != nil {
		add("tenant", ReasonInvalidTenant, "%v", err)
	} else if b.Tenant != "" && b.Tenant != tenant {
		add("tenant", ReasonTenantMismatch, "body names tenant %q but the budget is for %q", b.Tenant, tenant)
	}
	if b.Period != BudgetMonthly && b.Period != BudgetDaily {
		add("period", ReasonInvalidValue, "period %q; want monthly or daily", b.Period)
	}
	if b.Limit <= 0 || b.Limit > MaxMoney {
		add("limit", ReasonOutOfRange, "limit %s; want more than 0 and at most %s", b.Limit, MaxMoney)
	}
	if !slices.Contains(BudgetPolicies, b.Policy) {
		add("policy", ReasonInvalidValue, "policy %q; want one of %v", b.Policy, BudgetPolicies)
	}
	sortFieldErrors(errs)
	return newValidationError(errs)
}

// DecodeBudget decodes and validates a budget for tenant.
func DecodeBudget(data []byte, tenant string) (Budget, error) {
	var b Budget
	if err := decodeValidated(data, &b, func() error { return b.Validate(tenant) }); err != nil {
		return b, moneyFieldError(data, err)
	}
	b.SchemaVersion, b.Tenant = SchemaVersion, tenant
	return b, nil
}

// PeriodOf returns the UTC calendar period of p that contains t: its name
// ("2026-11" or "2026-11-03") and its bounds [start, end).
func PeriodOf(p BudgetPeriod, t time.Time) (name string, start, end time.Time) {
	t = t.UTC()
	if p == BudgetDaily {
		start = time.Date(t.Year(), t.Month(), t.Day(), 0, 0, 0, 0, time.UTC)
		return start.Format(time.DateOnly), start, start.AddDate(0, 0, 1)
	}
	start = time.Date(t.Year(), t.Month(), 1, 0, 0, 0, 0, time.UTC)
	return start.Format("2006-01"), start, start.AddDate(0, 1, 0)
}

// ParsePeriod reads "2026-11" (a month) or "2026-11-03" (a day) as UTC
// bounds [start, end).
func ParsePeriod(s string) (start, end time.Time, err error) {
	if t, err := time.Parse("2006-01", s); err == nil {
		return t, t.AddDate(0, 1, 0), nil
	}
	if t, err := time.Parse(time.DateOnly, s); err == nil {
		return t, t.AddDate(0, 0, 1), nil
	}
	return time.Time{}, time.Time{}, fmt.Errorf("%s: period %q: want YYYY-MM or YYYY-MM-DD", ReasonInvalidPeriod, s)
}

// BudgetStatus is billing's view of one tenant's budget in the current
// period, stored in BucketBudgetStatus under the tenant whenever it
// changes. The scheduler's intake reads it (Admit); people read it with
// gpuctl budget get.
type BudgetStatus struct {
	SchemaVersion int          `json:"schemaVersion"`
	Tenant        string       `json:"tenant"`
	Period        BudgetPeriod `json:"period"`
	// PeriodName is "2026-11" or "2026-11-03"; the status holds for
	// [PeriodStart, PeriodEnd) only: after it, it says nothing.
	PeriodName  string       `json:"periodName"`
	PeriodStart time.Time    `json:"periodStart"`
	PeriodEnd   time.Time    `json:"periodEnd"`
	Currency    string       `json:"currency,omitempty"`
	LimitMicros int64        `json:"limitMicros"`
	SpentMicros int64        `json:"spentMicros"`
	Policy      BudgetPolicy `json:"policy"`
	// Crossed are the thresholds of BudgetThresholds reached now; Alerted
	// those alerted this period (kept when a raised limit uncrosses one,
	// so that each threshold alerts once per period).
	Crossed []int `json:"crossed,omitempty"`
	Alerted []int `json:"alerted,omitempty"`
	// Exceeded is true at 100% or more.
	Exceeded bool `json:"exceeded"`
	// SpotPools are the pools whose every machine is spot, for the
	// spot-only policy.
	SpotPools []string  `json:"spotPools,omitempty"`
	Time      time.Time `json:"time"`
}

// CEType is the CloudEvents type of a budget status.
func (BudgetStatus) CEType() string { return "io.gpuplane.billing.budget_status.v1" }

// Percent is the spend in percent of the limit, for display.
func (s BudgetStatus) Percent() float64 {
	if s.LimitMicros <= 0 {
		return 0
	}
	return float64(s.SpentMicros) * 100 / float64(s.LimitMicros)
}

// Admit decides, at now, whether req may be accepted under s. It returns
// nil to admit, or a *ValidationError with reason budget_exceeded. A
// status of another period, or of a policy that only notifies, admits.
func (s *BudgetStatus) Admit(req JobRequest, now time.Time) error {
	if s == nil || !s.Exceeded || now.Before(s.PeriodStart) || !now.Before(s.PeriodEnd) {
		return nil
	}
	spent := fmt.Sprintf("tenant %s has spent %s %s of its %s %s %s budget for %s", s.Tenant,
		Money(s.SpentMicros).CentString(), s.Currency, Money(s.LimitMicros).CentString(), s.Currency, s.Period, s.PeriodName)
	next := s.PeriodEnd.UTC().Format(time.RFC3339)
	var msg string
	switch s.Policy {
	case PolicyReject:
		msg = fmt.Sprintf("%s; policy reject: no new jobs until %s or until the budget is raised", spent, next)
	case PolicySpotOnly:
		if req.Priority == PriorityBestEffort || req.Pool != "" && slices.Contains(s.SpotPools, req.Pool) {
			return nil
		}
		pools := "none"
		if len(s.SpotPools) > 0 {
			pools = strings.Join(s.SpotPools, ", ")
		}
		msg = fmt.Sprintf("%s; policy spot-only: until %s only jobs with priority best-effort or a spot pool (%s) are admitted", spent, next, pools)
	default:
		return nil
	}
	return newValidationError([]FieldError{{Field: "tenant", Reason: ReasonBudgetExceeded, Message: msg}})
}

// AlertKindBudget is the Alert kind of budget alerts, published by
// billing on SubjectAlert(AlertKindBudget): one firing alert per tenant,
// period and threshold, keyed "<tenant>/<period>/<threshold>", with the
// labels tenant, period, threshold and policy.
const AlertKindBudget = "budget"

// BudgetAlertID is the Nats-Msg-Id of a budget alert.
func BudgetAlertID(tenant, period string, threshold int) string {
	return "alert/budget/" + tenant + "/" + period + "/" + strconv.Itoa(threshold)
}

// UsageSegmentID is the Nats-Msg-Id and idempotency key of the usage
// record of one segment of an allocation's run (segments count from 0).
// UsageID(allocationID) is the ID of the single record billing wrote per
// allocation before segments existed.
func UsageSegmentID(allocationID string, segment int) string {
	return UsageID(allocationID) + "/s" + strconv.Itoa(segment)
}
