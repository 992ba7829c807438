package fragsim

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
)

// ParseError locates a bad value in a trace file. Line and Column (the
// field's position in the record) are 1-based; Column is 0 when the whole
// line is at fault.
type ParseError struct {
	File   string
	Line   int
	Column int
	Field  string
	Err    error
}

func (e *ParseError) Error() string {
	switch {
	case e.Column > 0 && e.Field != "":
		return fmt.Sprintf("%s:%d: column %d (%s): %v", e.File, e.Line, e.Column, e.Field, e.Err)
	case e.Column > 0:
		return fmt.Sprintf("%s:%d: column %d: %v", e.File, e.Line, e.Column, e.Err)
	default:
		return fmt.Sprintf("%s:%d: %v", e.File, e.Line, e.Err)
	}
}

func (e *ParseError) Unwrap() error { return e.Err }

// Pod is one task of a pod list.
type Pod struct {
	Name string
	Request
	// Spec is the gpu_spec column as written ("" for any model): the FGD
	// paper groups typical tasks by it.
	Spec string
}

// table reads a CSV file with a header and hands out typed fields by
// column name, reporting errors with their line and column.
type table struct {
	file string
	r    *csv.Reader
	col  map[string]int
	rec  []string
	line int
	// width is the header's field count; every record must match it.
	width int
}

func newTable(r io.Reader, file string, required, optional []string) (*table, error) {
	cr := csv.NewReader(r)
	cr.ReuseRecord = true
	cr.FieldsPerRecord = -1 // checked in next, to say which line is short
	header, err := cr.Read()
	if errors.Is(err, io.EOF) {
		return nil, &ParseError{File: file, Line: 1, Err: errors.New("empty file: no header")}
	}
	if err != nil {
		return nil, csvError(file, err)
	}
	t := &table{file: file, r: cr, col: map[string]int{}}
	for i, h := range header {
		t.col[strings.TrimSpace(strings.TrimPrefix(h, "\ufeff"))] = i
	}
	var missing []string
	for _, name := range required {
		if _, ok := t.col[name]; !ok {
			missing = append(missing, name)
		}
	}
	if len(missing) > 0 {
		return nil, &ParseError{File: file, Line: 1, Err: fmt.Errorf("header lacks column(s) %s", strings.Join(missing, ", "))}
	}
	for _, name := range optional {
		if _, ok := t.col[name]; !ok {
			t.col[name] = -1
		}
	}
	t.width = len(header)
	return t, nil
}

// next reads one record; it returns io.EOF at the end.
func (t *table) next() error {
	rec, err := t.r.Read()
	if err != nil {
		if errors.Is(err, io.EOF) {
			return err
		}
		return csvError(t.file, err)
	}
	t.line, _ = t.r.FieldPos(0)
	if len(rec) != t.width {
		return &ParseError{File: t.file, Line: t.line, Err: fmt.Errorf("%d fields, header has %d", len(rec), t.width)}
	}
	t.rec = rec
	return nil
}

func (t *table) str(name string) string {
	i := t.col[name]
	if i < 0 {
		return ""
	}
	return strings.TrimSpace(t.rec[i])
}

// errAt blames the named field of the current record.
func (t *table) errAt(name string, err error) error {
	return &ParseError{File: t.file, Line: t.line, Column: t.col[name] + 1, Field: name, Err: err}
}

// int reads a non-negative integer field.
func (t *table) int(name string) (int64, error) {
	s := t.str(name)
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		return 0, t.errAt(name, fmt.Errorf("%q is not an integer", s))
	}
	if v < 0 {
		return 0, t.errAt(name, fmt.Errorf("%d is negative", v))
	}
	return v, nil
}

func csvError(file string, err error) error {
	var pe *csv.ParseError
	if errors.As(err, &pe) {
		// pe.Column counts bytes, not fields: say so rather than pass it
		// off as a column number.
		return &ParseError{File: file, Line: pe.Line, Err: fmt.Errorf("byte %d: %w", pe.Column, pe.Err)}
	}
	return fmt.Errorf("%s: %w", file, err)
}

// LoadNodes reads a node list (columns sn, cpu_milli, memory_mib, gpu,
// model) and registers its GPU models.
func LoadNodes(r io.Reader, file string) ([]NodeSpec, *Models, error) {
	t, err := newTable(r, file, []string{"sn", "cpu_milli", "memory_mib", "gpu", "model"}, nil)
	if err != nil {
		return nil, nil, err
	}
	models := NewModels()
	seen := map[string]int{}
	var nodes []NodeSpec
	for {
		if err := t.next(); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return nil, nil, err
		}
		n := NodeSpec{Name: t.str("sn")}
		if n.Name == "" {
			return nil, nil, t.errAt("sn", errors.New("empty node name"))
		}
		if prev, dup := seen[n.Name]; dup {
			return nil, nil, t.errAt("sn", fmt.Errorf("node %q already listed on line %d", n.Name, prev))
		}
		seen[n.Name] = t.line
		if n.CPUMilli, err = t.int("cpu_milli"); err != nil {
			return nil, nil, err
		}
		if n.MemoryMiB, err = t.int("memory_mib"); err != nil {
			return nil, nil, err
		}
		gpus, err := t.int("gpu")
		if err != nil {
			return nil, nil, err
		}
		if gpus > MaxGPUsPerNode {
			return nil, nil, t.errAt("gpu", fmt.Errorf("%d GPUs, at most %d per node", gpus, MaxGPUsPerNode))
		}
		n.GPUs = int(gpus)
		if n.Model, err = models.Add(t.str("model")); err != nil {
			return nil, nil, t.errAt("model", err)
		}
		nodes = append(nodes, n)
	}
	if len(nodes) == 0 {
		return nil, nil, &ParseError{File: file, Line: 2, Err: errors.New("no nodes")}
	}
	return nodes, models, nil
}

// LoadPods reads a pod list (columns name, cpu_milli, memory_mib, num_gpu,
// gpu_milli and optionally gpu_spec, models separated by "|"). Other
// columns are ignored.
func LoadPods(r io.Reader, file string, models *Models) ([]Pod, error) {
	t, err := newTable(r, file, []string{"name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli"}, []string{"gpu_spec"})
	if err != nil {
		return nil, err
	}
	var pods []Pod
	for {
		if err := t.next(); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			return nil, err
		}
		p := Pod{Name: t.str("name"), Spec: t.str("gpu_spec")}
		if p.CPUMilli, err = t.int("cpu_milli"); err != nil {
			return nil, err
		}
		if p.MemoryMiB, err = t.int("memory_mib"); err != nil {
			return nil, err
		}
		n, err := t.int("num_gpu")
		if err != nil {
			return nil, err
		}
		if n > MaxGPUsPerNode {
			return nil, t.errAt("num_gpu", fmt.Errorf("%d GPUs, at most %d per node", n, MaxGPUsPerNode))
		}
		p.GPUs = int(n)
		if p.GPUMilli, err = t.int("gpu_milli"); err != nil {
			return nil, err
		}
		if p.GPUs == 0 && p.GPUMilli == 0 && p.Spec != "" {
			p.Spec = "" // a model constraint means nothing to a CPU-only task
		}
		var names []string
		for _, s := range strings.Split(p.Spec, "|") {
			if s = strings.TrimSpace(s); s != "" {
				names = append(names, s)
			}
		}
		p.Models = models.Set(names)
		if err := p.Validate(); err != nil {
			field := "gpu_milli"
			if p.CPUMilli < 0 {
				field = "cpu_milli"
			}
			return nil, t.errAt(field, err)
		}
		pods = append(pods, p)
	}
	if len(pods) == 0 {
		return nil, &ParseError{File: file, Line: 2, Err: errors.New("no pods")}
	}
	return pods, nil
}

// LoadNodesFile and LoadPodsFile open the files for LoadNodes and LoadPods.
func LoadNodesFile(path string) ([]NodeSpec, *Models, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	return LoadNodes(f, path)
}

// LoadPodsFile opens path for LoadPods.
func LoadPodsFile(path string, models *Models) ([]Pod, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return LoadPods(f, path, models)
}
