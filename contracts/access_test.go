package contracts

import (
	"go/ast"
	"go/parser"
	"go/token"
	"slices"
	"strconv"
	"strings"
	"testing"
)

// TestEveryFamilyHasAnAccessRow: every Subject*All constant of subjects.go
// (but the unions of several families) has exactly one row in Families, and
// every KV bucket of KeyValues one in Buckets: a new subject or bucket
// cannot ship without saying who may use it.
func TestEveryFamilyHasAnAccessRow(t *testing.T) {
	fset := token.NewFileSet()
	f, err := parser.ParseFile(fset, "subjects.go", nil, 0)
	if err != nil {
		t.Fatal(err)
	}
	unions := map[string]bool{"SubjectAllocAll": true, "SubjectNodesAll": true}
	var wildcards []string
	ast.Inspect(f, func(n ast.Node) bool {
		vs, ok := n.(*ast.ValueSpec)
		if !ok {
			return true
		}
		for i, name := range vs.Names {
			if !strings.HasPrefix(name.Name, "Subject") || !strings.HasSuffix(name.Name, "All") || unions[name.Name] {
				continue
			}
			lit, ok := vs.Values[i].(*ast.BasicLit)
			if !ok {
				continue
			}
			v, _ := strconv.Unquote(lit.Value)
			wildcards = append(wildcards, v)
		}
		return true
	})
	if len(wildcards) < 15 {
		t.Fatalf("found only %d subject families in subjects.go", len(wildcards))
	}
	for _, w := range wildcards {
		n := 0
		for _, fam := range Families {
			if fam.Wildcard == w {
				n++
			}
		}
		if n != 1 {
			t.Errorf("subject family %s has %d rows in Families, want 1", w, n)
		}
	}
	for _, kv := range KeyValues(StreamOptions{}) {
		if !slices.ContainsFunc(Buckets, func(b BucketAccess) bool { return b.Bucket == kv.Bucket }) {
			t.Errorf("KV bucket %s has no row in Buckets", kv.Bucket)
		}
	}
	for _, fam := range Families {
		if len(fam.Publishers) == 0 {
			t.Errorf("family %s: nobody may publish it", fam.Wildcard)
		}
		if fam.Scope != ScopeNone && fam.Scoped == nil {
			t.Errorf("family %s is scoped but has no Scoped subjects", fam.Wildcard)
		}
	}
}

// TestAccessScopesLiterally: a node agent's and a tenant's permissions
// name only their own node or tenant, and no identity but the operator may
// administer streams.
func TestAccessScopesLiterally(t *testing.T) {
	tests := []struct {
		id      Identity
		mine    string
		notMine string
	}{
		{Identity{Name: "node-n1", Role: BusNode, Scope: "n1"}, "gp.runs.n1", "gp.runs.*"},
		{Identity{Name: "tenant-acme", Role: BusTenant, Scope: "acme"}, "gp.jobs.submit.acme", "gp.jobs.submit.*"},
	}
	for _, tc := range tests {
		p, err := Access(tc.id)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Contains(p.Publish, tc.mine) {
			t.Errorf("%s may not publish %s", tc.id.Name, tc.mine)
		}
		if slices.Contains(p.Publish, tc.notMine) {
			t.Errorf("%s may publish %s", tc.id.Name, tc.notMine)
		}
	}
	for _, r := range BusRoles {
		id := Identity{Name: "x", Role: r}
		switch r {
		case BusOperator:
			continue
		case BusNode:
			id.Scope = "n1"
		case BusTenant:
			id.Scope = "acme"
		}
		p, err := Access(id)
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range p.Publish {
			for _, admin := range []string{"$JS.API.STREAM.PURGE", "$JS.API.STREAM.DELETE", "$JS.API.STREAM.UPDATE", "$JS.API.STREAM.MSG.DELETE", ">"} {
				if strings.HasPrefix(s, admin) || s == "$JS.API.>" || s == "$JS.API.STREAM.>" {
					t.Errorf("role %s may publish %s", r, s)
				}
			}
		}
	}
}

func TestIdentityValidate(t *testing.T) {
	tests := []struct {
		id Identity
		ok bool
	}{
		{Identity{Name: "scheduler", Role: BusScheduler}, true},
		{Identity{Name: "node-n1", Role: BusNode, Scope: "n1"}, true},
		{Identity{Name: "node-n1", Role: BusNode}, false},
		{Identity{Name: "tenant-x", Role: BusTenant, Scope: "ACME"}, false},
		{Identity{Name: "a.b", Role: BusScheduler}, false},
		{Identity{Name: "s", Role: BusScheduler, Scope: "n1"}, false},
		{Identity{Name: "s", Role: "root"}, false},
	}
	for _, tc := range tests {
		if err := tc.id.Validate(); (err == nil) != tc.ok {
			t.Errorf("%+v: Validate() = %v, want ok=%v", tc.id, err, tc.ok)
		}
	}
}
