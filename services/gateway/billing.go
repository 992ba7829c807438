package gateway

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/libs/bus"
)

// The billing endpoints: the price book and the budgets are KV documents
// the gateway reads and writes with compare-and-set (validated with the
// same contracts functions gpuctl uses); the invoice is built from the
// usage records of the read model, as anyone holding USAGE could.
//
// The price book and budgets are administrator operations; until
// authentication exists (a later issue) the gateway does not tell admins
// from tenants, like the fault endpoint.

// kvBuckets opens the administrators' KV buckets (billing and
// scheduling) on first use, so that the gateway starts, and serves jobs,
// whatever state the buckets are in.
type kvBuckets struct {
	bus *bus.Bus

	mu      sync.Mutex
	buckets map[string]jetstream.KeyValue
}

func newKVBuckets(b *bus.Bus) *kvBuckets {
	return &kvBuckets{bus: b, buckets: map[string]jetstream.KeyValue{}}
}

func (k *kvBuckets) get(ctx context.Context, bucket string) (jetstream.KeyValue, error) {
	if k == nil {
		return nil, errors.New("KV buckets are not configured")
	}
	k.mu.Lock()
	defer k.mu.Unlock()
	if kv, ok := k.buckets[bucket]; ok {
		return kv, nil
	}
	ctx, cancel := context.WithTimeout(ctx, publishTimeout)
	defer cancel()
	kv, err := k.bus.KeyValue(ctx, bucket)
	if err != nil {
		return nil, err
	}
	k.buckets[bucket] = kv
	return kv, nil
}

// kv answers 503 and returns nil when bucket cannot be opened.
func (s *server) kv(w http.ResponseWriter, r *http.Request, bucket string) jetstream.KeyValue {
	kv, err := s.buckets.get(r.Context(), bucket)
	if err != nil {
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("KV bucket %s: %v", bucket, err), nil)
		return nil
	}
	return kv
}

// readBody reads a request body of at most limit bytes; it answers 413 or
// 400 and returns false when it cannot.
func readBody(w http.ResponseWriter, r *http.Request, limit int64) ([]byte, bool) {
	// No server-wide ReadTimeout (it would cut event streams): bound the
	// body read here instead.
	_ = http.NewResponseController(w).SetReadDeadline(time.Now().Add(30 * time.Second))
	data, err := io.ReadAll(http.MaxBytesReader(w, r.Body, limit))
	if err != nil {
		if tooLarge, ok := errors.AsType[*http.MaxBytesError](err); ok {
			writeError(w, http.StatusRequestEntityTooLarge, contracts.ReasonTooLarge,
				fmt.Sprintf("body exceeds the limit of %d bytes", tooLarge.Limit), nil)
			return nil, false
		}
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidRequest, fmt.Sprintf("reading the body: %v", err), nil)
		return nil, false
	}
	if len(data) > 0 && !jsonMediaType(w, r) {
		return nil, false
	}
	return data, true
}

// jsonMediaType answers 415 and returns false for a body declared as
// anything but application/json (charset, if given, utf-8): a form, text
// or YAML body is not read as JSON by accident. A body declared as
// nothing is read as JSON, as the API takes nothing else; that keeps
// plain clients (curl --data-binary, scripts) working.
func jsonMediaType(w http.ResponseWriter, r *http.Request) bool {
	ct := r.Header.Get("Content-Type")
	if ct == "" {
		return true
	}
	mt, params, err := mime.ParseMediaType(ct)
	if err == nil && mt == "application/json" {
		if cs, ok := params["charset"]; !ok || strings.EqualFold(cs, "utf-8") {
			return true
		}
	}
	writeError(w, http.StatusUnsupportedMediaType, contracts.ReasonUnsupportedMediaType,
		fmt.Sprintf("the body is declared as %q; send JSON as Content-Type: application/json", ct), nil)
	return false
}

// priceBookDoc reads the book and the watermark.
// A book that does not decode comes back as an *unreadableError, with
// the revision it is at in doc (and an empty book), so that a PUT can
// replace it; a watermark that does not decode is an *unreadableError
// too.
func priceBookDoc(ctx context.Context, kv jetstream.KeyValue) (contracts.PriceBookDoc, error) {
	var doc contracts.PriceBookDoc
	var bookErr *unreadableError
	e, err := kv.Get(ctx, contracts.KeyPriceBook)
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound):
		doc.Book.Versions = []contracts.PriceVersion{}
	case err != nil:
		return doc, err
	default:
		doc.Revision = e.Revision()
		if err := json.Unmarshal(e.Value(), &doc.Book); err != nil {
			// Read on (the watermark), so that a PUT can replace it.
			doc.Book = contracts.PriceBook{Versions: []contracts.PriceVersion{}}
			bookErr = &unreadableError{bucket: kv.Bucket(), key: contracts.KeyPriceBook, rev: e.Revision(), err: err}
		}
	}
	m, err := kv.Get(ctx, contracts.KeyMeteredUntil)
	switch {
	case errors.Is(err, jetstream.ErrKeyNotFound):
	case err != nil:
		return doc, err
	default:
		if doc.MeteredUntil, err = time.Parse(time.RFC3339, string(m.Value())); err != nil {
			// Billing writes the watermark after each metering pass: a
			// bad one is reported until it does.
			return doc, &unreadableError{bucket: kv.Bucket(), key: contracts.KeyMeteredUntil, rev: m.Revision(),
				err: fmt.Errorf("metering watermark %q: %w", m.Value(), err)}
		}
	}
	if bookErr != nil {
		return doc, bookErr
	}
	return doc, nil
}

// repairBook says how an administrator replaces an unreadable book.
func repairBook(e *unreadableError) string {
	if e.key == contracts.KeyMeteredUntil {
		return "billing rewrites it after its next metering pass; until then the book cannot be changed"
	}
	return fmt.Sprintf("replace it with PUT /v1/pricebook?revision=%d", e.rev)
}

func (s *server) getPriceBook(w http.ResponseWriter, r *http.Request) {
	kv := s.kv(w, r, contracts.BucketPriceBook)
	if kv == nil {
		return
	}
	doc, err := priceBookDoc(r.Context(), kv)
	if ue, ok := errors.AsType[*unreadableError](err); ok {
		s.writeUnreadable(w, "the stored price book", ue, repairBook(ue))
		return
	}
	if err != nil {
		s.internalError(w, "price book", err)
		return
	}
	writeJSON(w, http.StatusOK, doc)
}

// putPriceBook replaces the book. It refuses a book that is invalid
// (400 with every field error), that reaches back before now or before the
// metered usage (400 effective_in_past / immutable_version), or, with
// ?revision=N, that was edited since revision N (409 conflict).
func (s *server) putPriceBook(w http.ResponseWriter, r *http.Request) {
	var want uint64
	if v := r.URL.Query().Get("revision"); v != "" {
		n, err := strconv.ParseUint(v, 10, 64)
		if err != nil {
			msg := fmt.Sprintf("revision %q: want the revision the book was read at", v)
			writeError(w, http.StatusBadRequest, contracts.ReasonInvalidValue, msg,
				[]contracts.FieldError{{Field: "revision", Reason: contracts.ReasonInvalidValue, Message: msg}})
			return
		}
		want = n
	}
	data, ok := readBody(w, r, s.cfg.MaxBodyBytes)
	if !ok {
		return
	}
	book, err := contracts.DecodePriceBook(data)
	if err != nil {
		writeInvalid(w, "invalid price book", err)
		return
	}
	kv := s.kv(w, r, contracts.BucketPriceBook)
	if kv == nil {
		return
	}
	ctx, cancel := context.WithTimeout(r.Context(), publishTimeout)
	defer cancel()
	doc, err := priceBookDoc(ctx, kv)
	if ue, ok := errors.AsType[*unreadableError](err); ok && ue.key == contracts.KeyPriceBook {
		// Nothing of the unreadable book can be protected: it is
		// replaced (over its revision), and the new book must still
		// start after the metered usage.
		s.log.Warn("replacing an unreadable price book", "revision", ue.rev, "err", ue.err)
	} else if ok {
		s.writeUnreadable(w, "the metering watermark", ue, repairBook(ue))
		return
	} else if err != nil {
		s.internalError(w, "price book", err)
		return
	}
	if want != 0 && want != doc.Revision {
		writeError(w, http.StatusConflict, contracts.ReasonConflict,
			fmt.Sprintf("the price book is at revision %d, not %d: read it again", doc.Revision, want), nil)
		return
	}
	if err := book.ValidateChange(doc.Book, cutoff(s.now(), doc.MeteredUntil)); err != nil {
		writeInvalid(w, "invalid price book", err)
		return
	}
	book.SchemaVersion = contracts.SchemaVersion
	body, err := json.Marshal(book)
	if err != nil {
		s.internalError(w, "price book", err)
		return
	}
	var rev uint64
	if doc.Revision == 0 {
		rev, err = kv.Create(ctx, contracts.KeyPriceBook, body)
	} else {
		rev, err = kv.Update(ctx, contracts.KeyPriceBook, body, doc.Revision)
	}
	if err != nil {
		if errors.Is(err, jetstream.ErrKeyExists) || errors.Is(err, jetstream.ErrKeyRevisionMismatch) {
			writeError(w, http.StatusConflict, contracts.ReasonConflict, "the price book changed while this edit was checked: read it again", nil)
			return
		}
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("writing the price book: %v", err), nil)
		return
	}
	s.log.Info("price book replaced", "revision", rev, "versions", len(book.Versions))
	writeJSON(w, http.StatusOK, contracts.PriceBookDoc{Book: book, Revision: rev, MeteredUntil: doc.MeteredUntil})
}

// cutoff is the earliest instant a new price version may take effect: now
// (rounded up to the second) or the end of the metered usage if later.
func cutoff(now, meteredUntil time.Time) time.Time {
	c := now.UTC().Truncate(time.Second)
	if c.Before(now) {
		c = c.Add(time.Second)
	}
	if meteredUntil.After(c) {
		return meteredUntil
	}
	return c
}

func (s *server) budgetDoc(ctx context.Context, w http.ResponseWriter, r *http.Request, tenant string) (contracts.BudgetDoc, bool) {
	doc := contracts.BudgetDoc{Tenant: tenant}
	budgets := s.kv(w, r, contracts.BucketBudgets)
	if budgets == nil {
		return doc, false
	}
	statuses := s.kv(w, r, contracts.BucketBudgetStatus)
	if statuses == nil {
		return doc, false
	}
	if e, err := budgets.Get(ctx, tenant); err == nil {
		var b contracts.Budget
		if err := json.Unmarshal(e.Value(), &b); err != nil {
			// Reported, not read as "no budget": billing does not
			// enforce it either (budget.go logs it).
			s.writeUnreadable(w, "the budget of tenant "+tenant,
				&unreadableError{bucket: budgets.Bucket(), key: tenant, rev: e.Revision(), err: err},
				fmt.Sprintf("replace it with PUT /v1/tenants/%s/budget, or delete it", tenant))
			return doc, false
		}
		doc.Budget, doc.Revision = &b, e.Revision()
	} else if !errors.Is(err, jetstream.ErrKeyNotFound) {
		s.internalError(w, "budget", err)
		return doc, false
	}
	if e, err := statuses.Get(ctx, tenant); err == nil {
		var st contracts.BudgetStatus
		if json.Unmarshal(e.Value(), &st) == nil {
			doc.Status = &st
		}
	} else if !errors.Is(err, jetstream.ErrKeyNotFound) {
		s.internalError(w, "budget status", err)
		return doc, false
	}
	return doc, true
}

func (s *server) getBudget(w http.ResponseWriter, r *http.Request) {
	tenant, ok := tenant(w, r)
	if !ok {
		return
	}
	if doc, ok := s.budgetDoc(r.Context(), w, r, tenant); ok {
		writeJSON(w, http.StatusOK, doc)
	}
}

func (s *server) putBudget(w http.ResponseWriter, r *http.Request) {
	tenant, ok := tenant(w, r)
	if !ok {
		return
	}
	data, ok := readBody(w, r, s.cfg.MaxBodyBytes)
	if !ok {
		return
	}
	b, err := contracts.DecodeBudget(data, tenant)
	if err != nil {
		writeInvalid(w, "invalid budget", err)
		return
	}
	kv := s.kv(w, r, contracts.BucketBudgets)
	if kv == nil {
		return
	}
	body, _ := json.Marshal(b)
	ctx, cancel := context.WithTimeout(r.Context(), publishTimeout)
	defer cancel()
	if _, err := kv.Put(ctx, tenant, body); err != nil {
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("writing the budget: %v", err), nil)
		return
	}
	s.log.Info("budget set", "tenant", tenant, "period", b.Period, "limit", b.Limit.String(), "policy", b.Policy)
	if doc, ok := s.budgetDoc(ctx, w, r, tenant); ok {
		writeJSON(w, http.StatusOK, doc)
	}
}

func (s *server) deleteBudget(w http.ResponseWriter, r *http.Request) {
	tenant, ok := tenant(w, r)
	if !ok {
		return
	}
	kv := s.kv(w, r, contracts.BucketBudgets)
	if kv == nil {
		return
	}
	if err := kv.Delete(r.Context(), tenant); err != nil {
		writeError(w, http.StatusServiceUnavailable, contracts.ReasonUnavailable, fmt.Sprintf("deleting the budget: %v", err), nil)
		return
	}
	s.log.Info("budget removed", "tenant", tenant)
	writeJSON(w, http.StatusOK, contracts.BudgetDoc{Tenant: tenant})
}

// invoice bills a tenant for ?period=YYYY-MM (or YYYY-MM-DD) from the
// usage of the read model (contracts.BuildInvoice's answer).
func (s *server) invoice(w http.ResponseWriter, r *http.Request) {
	tenant, ok := tenant(w, r)
	if !ok {
		return
	}
	period := r.URL.Query().Get("period")
	if period == "" {
		period = s.now().UTC().Format("2006-01")
	}
	if _, _, err := contracts.ParsePeriod(period); err != nil {
		writeError(w, http.StatusBadRequest, contracts.ReasonInvalidPeriod, err.Error(),
			[]contracts.FieldError{{Field: "period", Reason: contracts.ReasonInvalidPeriod, Message: err.Error()}})
		return
	}
	if !s.modelReady(w) {
		return
	}
	inv, err := s.model.Invoice(r.Context(), tenant, period)
	if err != nil {
		s.internalError(w, "invoice", err)
		return
	}
	writeJSON(w, http.StatusOK, inv)
}
