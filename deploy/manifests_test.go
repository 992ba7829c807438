// Package deploy_test checks the deployment artefacts of deploy/: the
// Kubernetes manifests (rendered with kustomize and decoded strictly into
// the Kubernetes API types), the systemd units and the NATS cluster
// configuration.
package deploy_test

import (
	"cmp"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/util/intstr"
	"k8s.io/apimachinery/pkg/util/validation"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

// rendered is one overlay's objects, decoded.
type rendered struct {
	deployments  []*appsv1.Deployment
	statefulSets []*appsv1.StatefulSet
	daemonSets   []*appsv1.DaemonSet
	pdbs         []*policyv1.PodDisruptionBudget
	configMaps   map[string]*corev1.ConfigMap
	services     []*corev1.Service
	policies     []*networkingv1.NetworkPolicy
	namespaces   []*corev1.Namespace
}

// render builds an overlay with kustomize and decodes every object
// strictly: a field the API type does not have (a typo, a field of another
// version) fails the test, as the API server would refuse it.
func render(t *testing.T, overlay string) *rendered {
	t.Helper()
	k := krusty.MakeKustomizer(krusty.MakeDefaultOptions())
	rm, err := k.Run(filesys.MakeFsOnDisk(), filepath.Join("kubernetes", "overlays", overlay))
	if err != nil {
		t.Fatalf("kustomize build %s: %v", overlay, err)
	}
	r := &rendered{configMaps: map[string]*corev1.ConfigMap{}}
	for _, res := range rm.Resources() {
		data, err := res.AsYAML()
		if err != nil {
			t.Fatal(err)
		}
		var tm metav1.TypeMeta
		if err := yaml.Unmarshal(data, &tm); err != nil {
			t.Fatal(err)
		}
		var obj any
		switch tm.APIVersion + "/" + tm.Kind {
		case "apps/v1/Deployment":
			o := &appsv1.Deployment{}
			r.deployments, obj = append(r.deployments, o), o
		case "apps/v1/StatefulSet":
			o := &appsv1.StatefulSet{}
			r.statefulSets, obj = append(r.statefulSets, o), o
		case "apps/v1/DaemonSet":
			o := &appsv1.DaemonSet{}
			r.daemonSets, obj = append(r.daemonSets, o), o
		case "policy/v1/PodDisruptionBudget":
			o := &policyv1.PodDisruptionBudget{}
			r.pdbs, obj = append(r.pdbs, o), o
		case "v1/ConfigMap":
			obj = &corev1.ConfigMap{}
		case "v1/Service":
			o := &corev1.Service{}
			r.services, obj = append(r.services, o), o
		case "v1/Namespace":
			o := &corev1.Namespace{}
			r.namespaces, obj = append(r.namespaces, o), o
		case "networking.k8s.io/v1/NetworkPolicy":
			o := &networkingv1.NetworkPolicy{}
			r.policies, obj = append(r.policies, o), o
		default:
			t.Fatalf("%s: unexpected kind %s/%s", res.CurId(), tm.APIVersion, tm.Kind)
		}
		if err := yaml.UnmarshalStrict(data, obj); err != nil {
			t.Fatalf("%s does not decode strictly into %s: %v", res.CurId(), tm.Kind, err)
		}
		if cm, ok := obj.(*corev1.ConfigMap); ok {
			r.configMaps[cm.Name] = cm
		}
		if tm.Kind != "Namespace" && res.GetNamespace() != "gpuplane" {
			t.Errorf("%s is in namespace %q, want gpuplane", res.CurId(), res.GetNamespace())
		}
	}
	return r
}

// workload is a Deployment, StatefulSet or DaemonSet, seen the same way.
type workload struct {
	kind, name string
	replicas   int32
	selector   *metav1.LabelSelector
	pod        corev1.PodTemplateSpec
	// claims are a StatefulSet's volume claim templates, volumes too.
	claims []string
}

func (r *rendered) workloads() []workload {
	var ws []workload
	for _, d := range r.deployments {
		ws = append(ws, workload{"Deployment", d.Name, *d.Spec.Replicas, d.Spec.Selector, d.Spec.Template, nil})
	}
	for _, s := range r.statefulSets {
		var claims []string
		for _, c := range s.Spec.VolumeClaimTemplates {
			claims = append(claims, c.Name)
		}
		ws = append(ws, workload{"StatefulSet", s.Name, *s.Spec.Replicas, s.Spec.Selector, s.Spec.Template, claims})
	}
	for _, d := range r.daemonSets {
		ws = append(ws, workload{"DaemonSet", d.Name, 0, d.Spec.Selector, d.Spec.Template, nil})
	}
	return ws
}

var digestRef = regexp.MustCompile(`^gpuplane/[a-z0-9-]+@sha256:[0-9a-f]{64}$`)

// TestManifests renders each overlay and checks the invariants production
// relies on.
func TestManifests(t *testing.T) {
	used := map[string]bool{}
	for _, overlay := range []string{"production", "dev"} {
		t.Run(overlay, func(t *testing.T) {
			r := render(t, overlay)
			maps.Copy(used, checkWorkloads(t, r, overlay == "production"))
			checkBus(t, r)
			checkNATS(t, r)
			checkNodeAgent(t, r)
			if _, ok := r.workload("fleet-sim"); ok != (overlay == "dev") {
				t.Errorf("fleet-sim present: %v; want it in dev only", ok)
			}
		})
	}
	checkImageComponent(t, used)
}

func (r *rendered) workload(name string) (workload, bool) {
	for _, w := range r.workloads() {
		if w.name == name {
			return w, true
		}
	}
	return workload{}, false
}

// wantReplicas is each replicated workload's least replica count: the
// active/standby services two, active/active two or three, NATS three.
var wantReplicas = map[string]int32{
	"scheduler": 2, "resource-manager": 2, "autoscaler": 2,
	"billing": 2, "monitor": 2, "gateway": 3, "nats": 3, "redis": 1,
}

// devOnly are the workloads of the dev overlay alone, with their replicas
// (one simulated fleet: two would speak for the same machines).
var devOnly = map[string]int32{"fleet-sim": 1}

// identityOf names the identity (deploy/identities.yaml) whose creds a
// workload uses, where it is not the workload's own name.
var identityOf = map[string]string{"fleet-sim": "fleet"}

// checkWorkloads checks every workload and returns the images they use.
func checkWorkloads(t *testing.T, r *rendered, production bool) map[string]bool {
	images := map[string]bool{}
	seen := map[string]bool{}
	for _, w := range r.workloads() {
		id := w.kind + "/" + w.name
		seen[w.name] = true
		if w.kind != "DaemonSet" {
			want, ok := wantReplicas[w.name]
			if !ok && !production {
				want, ok = devOnly[w.name]
			}
			if !ok {
				t.Errorf("%s: unexpected workload", id)
			} else if w.replicas < want {
				t.Errorf("%s: %d replicas, want at least %d", id, w.replicas, want)
			}
		}
		sel, err := metav1.LabelSelectorAsSelector(w.selector)
		if err != nil || !sel.Matches(labels.Set(w.pod.Labels)) {
			t.Errorf("%s: selector %v does not select its pods (%v)", id, w.selector, err)
		}
		spec := w.pod.Spec
		if spec.AutomountServiceAccountToken == nil || *spec.AutomountServiceAccountToken {
			t.Errorf("%s: mounts a service account token it does not use", id)
		}
		for _, c := range slices.Concat(spec.InitContainers, spec.Containers) {
			cid := id + "/" + c.Name
			images[c.Image] = true
			if !digestRef.MatchString(c.Image) {
				t.Errorf("%s: image %q is not gpuplane/<name>@sha256:<digest>", cid, c.Image)
			}
			if c.ReadinessProbe == nil || c.LivenessProbe == nil {
				t.Errorf("%s: want readiness and liveness probes", cid)
			}
			for _, res := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
				if _, ok := c.Resources.Requests[res]; !ok {
					t.Errorf("%s: no %s request", cid, res)
				}
				lim, ok := c.Resources.Limits[res]
				if !ok {
					t.Errorf("%s: no %s limit", cid, res)
				} else if req, ok := c.Resources.Requests[res]; ok && req.Cmp(lim) > 0 {
					t.Errorf("%s: %s request %s above its limit %s", cid, res, req.String(), lim.String())
				}
			}
			checkSecurity(t, cid, w.name == "node-agent", spec.SecurityContext, c.SecurityContext)
			// A Go service's soft memory limit is gctune's: 3/4 of the
			// cgroup's. GOMEMLIMIT at the container's limit would let a heap
			// at GOGC=300 grow to the kill limit itself.
			for _, e := range c.Env {
				if e.Name == "GOMEMLIMIT" && e.ValueFrom != nil && e.ValueFrom.ResourceFieldRef != nil {
					t.Errorf("%s: GOMEMLIMIT from %s sets the collector's soft limit at the container's kill limit; leave it to gctune (3/4 of the cgroup's)", cid, e.ValueFrom.ResourceFieldRef.Resource)
				}
			}
			checkReferences(t, cid, w, c)
		}
		if w.replicas > 1 {
			checkPDB(t, r, id, w)
			checkAntiAffinity(t, id, w, production)
		}
	}
	for name := range wantReplicas {
		if !seen[name] {
			t.Errorf("no workload %s", name)
		}
	}
	if !seen["node-agent"] {
		t.Error("no node-agent DaemonSet")
	}
	return images
}

// checkReferences: what the API server would refuse or a pod would fail
// on, though it decodes: a mount of a volume the pod lacks, a probe on a
// port the container does not name, invalid names.
func checkReferences(t *testing.T, cid string, w workload, c corev1.Container) {
	t.Helper()
	vols := map[string]bool{}
	for _, v := range w.pod.Spec.Volumes {
		vols[v.Name] = true
	}
	for _, n := range w.claims {
		vols[n] = true
	}
	for _, m := range c.VolumeMounts {
		if !vols[m.Name] {
			t.Errorf("%s: mounts volume %q, which the pod does not have", cid, m.Name)
		}
	}
	ports := map[string]bool{}
	for _, p := range c.Ports {
		ports[p.Name] = true
		for _, msg := range validation.IsValidPortName(p.Name) {
			t.Errorf("%s: port name %q: %s", cid, p.Name, msg)
		}
	}
	for _, p := range []*corev1.Probe{c.StartupProbe, c.ReadinessProbe, c.LivenessProbe} {
		if p == nil {
			continue
		}
		var port *intstr.IntOrString
		switch {
		case p.HTTPGet != nil:
			port = &p.HTTPGet.Port
		case p.TCPSocket != nil:
			port = &p.TCPSocket.Port
		}
		if port != nil && port.Type == intstr.String && !ports[port.StrVal] {
			t.Errorf("%s: probe on port %q, which the container does not name", cid, port.StrVal)
		}
	}
	for _, e := range c.Env {
		for _, msg := range validation.IsEnvVarName(e.Name) {
			t.Errorf("%s: env %q: %s", cid, e.Name, msg)
		}
	}
	for _, msg := range validation.IsDNS1123Label(c.Name) {
		t.Errorf("%s: container name: %s", cid, msg)
	}
}

// checkSecurity: every container but the node agent runs as 65532, not
// root, unprivileged, with a read-only root file system and no added
// capability; the node agent alone is privileged (GPU devices).
func checkSecurity(t *testing.T, cid string, privileged bool, pod *corev1.PodSecurityContext, c *corev1.SecurityContext) {
	t.Helper()
	if c == nil || c.ReadOnlyRootFilesystem == nil || !*c.ReadOnlyRootFilesystem {
		t.Errorf("%s: root file system is writable", cid)
	}
	if privileged {
		if c == nil || c.Privileged == nil || !*c.Privileged {
			t.Errorf("%s: the node agent must be privileged to reach the GPUs", cid)
		}
		return
	}
	if c != nil && c.Privileged != nil && *c.Privileged {
		t.Errorf("%s: privileged", cid)
	}
	if c == nil || c.AllowPrivilegeEscalation == nil || *c.AllowPrivilegeEscalation {
		t.Errorf("%s: allows privilege escalation", cid)
	}
	if c == nil || c.Capabilities == nil || !slices.Contains(c.Capabilities.Drop, "ALL") || len(c.Capabilities.Add) > 0 {
		t.Errorf("%s: capabilities not all dropped", cid)
	}
	user, nonRoot := int64(-1), false
	if pod != nil {
		if pod.RunAsUser != nil {
			user = *pod.RunAsUser
		}
		nonRoot = pod.RunAsNonRoot != nil && *pod.RunAsNonRoot
	}
	if c != nil && c.RunAsUser != nil {
		user = *c.RunAsUser
	}
	if c != nil && c.RunAsNonRoot != nil {
		nonRoot = *c.RunAsNonRoot
	}
	if user != 65532 || !nonRoot {
		t.Errorf("%s: runs as user %d (runAsNonRoot %v), want 65532 and true", cid, user, nonRoot)
	}
}

// checkPDB: a replicated workload has exactly one PodDisruptionBudget
// selecting its pods, which lets a drain take a pod but never all.
func checkPDB(t *testing.T, r *rendered, id string, w workload) {
	t.Helper()
	var found []*policyv1.PodDisruptionBudget
	for _, p := range r.pdbs {
		sel, err := metav1.LabelSelectorAsSelector(p.Spec.Selector)
		if err == nil && sel.Matches(labels.Set(w.pod.Labels)) {
			found = append(found, p)
		}
	}
	if len(found) != 1 {
		t.Errorf("%s: %d PodDisruptionBudgets select its pods, want 1", id, len(found))
		return
	}
	p := found[0].Spec
	switch {
	case p.MinAvailable != nil && (p.MinAvailable.IntValue() < 1 || p.MinAvailable.IntValue() >= int(w.replicas)):
		t.Errorf("%s: minAvailable %s blocks every drain or allows losing all", id, p.MinAvailable.String())
	case p.MaxUnavailable != nil && (p.MaxUnavailable.IntValue() < 1 || p.MaxUnavailable.IntValue() > max(1, int(w.replicas-1)/2)):
		// More than a minority away loses a quorum (NATS) or most of
		// the capacity (the gateway).
		t.Errorf("%s: maxUnavailable %s with %d replicas", id, p.MaxUnavailable.String(), w.replicas)
	case p.MinAvailable == nil && p.MaxUnavailable == nil:
		t.Errorf("%s: PodDisruptionBudget bounds nothing", id)
	}
}

// checkAntiAffinity: the replicas of a workload avoid sharing a machine
// (required in production; preferred in dev, where one machine may be all
// there is).
func checkAntiAffinity(t *testing.T, id string, w workload, required bool) {
	t.Helper()
	a := w.pod.Spec.Affinity
	if a == nil || a.PodAntiAffinity == nil {
		t.Errorf("%s: no pod anti-affinity", id)
		return
	}
	terms := a.PodAntiAffinity.RequiredDuringSchedulingIgnoredDuringExecution
	if !required {
		for _, p := range a.PodAntiAffinity.PreferredDuringSchedulingIgnoredDuringExecution {
			terms = append(terms, p.PodAffinityTerm)
		}
	}
	for _, term := range terms {
		if term.TopologyKey != "kubernetes.io/hostname" {
			continue
		}
		sel, err := metav1.LabelSelectorAsSelector(term.LabelSelector)
		if err != nil {
			t.Errorf("%s: %v", id, err)
			continue
		}
		if sel.Matches(labels.Set(w.pod.Labels)) {
			return
		}
	}
	t.Errorf("%s: no anti-affinity of its replicas per machine (required: %v)", id, required)
}

// checkImageComponent: the generated component pins exactly the images
// the overlays use, together.
func checkImageComponent(t *testing.T, used map[string]bool) {
	t.Helper()
	data, err := os.ReadFile("kubernetes/images/kustomization.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var comp struct {
		Images []struct {
			Name   string `json:"name"`
			Digest string `json:"digest"`
		} `json:"images"`
	}
	if err := yaml.Unmarshal(data, &comp); err != nil {
		t.Fatal(err)
	}
	pinned := map[string]bool{}
	for _, im := range comp.Images {
		pinned[im.Name+"@"+im.Digest] = true
	}
	if !maps.Equal(pinned, used) {
		t.Errorf("images component pins %v, the manifests use %v: run make images", slices.Sorted(maps.Keys(pinned)), slices.Sorted(maps.Keys(used)))
	}
}

// busEnv resolves the environment a container sees from its envFrom
// ConfigMaps and env values.
func busEnv(t *testing.T, r *rendered, c corev1.Container) map[string]string {
	t.Helper()
	env := map[string]string{}
	for _, from := range c.EnvFrom {
		if from.ConfigMapRef == nil {
			continue
		}
		cm, ok := r.configMaps[from.ConfigMapRef.Name]
		if !ok {
			t.Errorf("%s: envFrom ConfigMap %s does not exist", c.Name, from.ConfigMapRef.Name)
			continue
		}
		maps.Copy(env, cm.Data)
	}
	for _, e := range c.Env {
		if e.ValueFrom == nil {
			env[e.Name] = e.Value
		}
	}
	return env
}

// checkBus: every gpuplane process reaches all three NATS servers over TLS
// with R3 streams and its own identity's creds, mounted where it looks.
func checkBus(t *testing.T, r *rendered) {
	t.Helper()
	var nats *appsv1.StatefulSet
	for _, s := range r.statefulSets {
		if s.Name == "nats" {
			nats = s
		}
	}
	if nats == nil {
		t.Fatal("no nats StatefulSet")
	}
	var want []string
	for i := range *nats.Spec.Replicas {
		want = append(want, fmt.Sprintf("nats://%s-%d.%s:4222", nats.Name, i, nats.Spec.ServiceName))
	}
	for _, w := range r.workloads() {
		if w.name == "nats" || w.name == "redis" {
			continue
		}
		for _, c := range w.pod.Spec.Containers {
			env := busEnv(t, r, c)
			cid := w.kind + "/" + w.name + "/" + c.Name
			if got := strings.Split(env["GPUPLANE_NATS_URL"], ","); !slices.Equal(got, want) {
				t.Errorf("%s: NATS URLs %v, want the three servers %v", cid, got, want)
			}
			if env["GPUPLANE_STREAM_REPLICAS"] != "3" {
				t.Errorf("%s: stream replicas %q, want 3", cid, env["GPUPLANE_STREAM_REPLICAS"])
			}
			checkMounted(t, cid, w.pod.Spec, c, env["GPUPLANE_NATS_CA"], "ca.pem")
			creds := env["GPUPLANE_NATS_CREDS"]
			wantKey := w.name + ".creds"
			if w.name == "node-agent" {
				wantKey = "" // a file of the machine's, not a secret's
			} else {
				id := cmp.Or(identityOf[w.name], w.name)
				wantKey = id + ".creds"
				if role, ok := identities(t)[id]; !ok || role != id {
					t.Errorf("%s: deploy/identities.yaml has no identity %s with role %s (gpuplane-creds would mint no %s)", cid, id, id, wantKey)
				}
			}
			checkListenPort(t, cid, c)
			checkMounted(t, cid, w.pod.Spec, c, creds, wantKey)
			flags := serviceFlags(t, w.name)
			for _, a := range c.Args {
				k, _, _ := strings.Cut(strings.TrimLeft(a, "-"), "=")
				if !strings.HasPrefix(a, "-") || !flags[k] {
					t.Errorf("%s: %s is not a flag of %s", cid, a, w.name)
				}
				if k == "replicas" || k == "nats" || k == "nats-ca" || k == "creds" {
					t.Errorf("%s: %s overrides the shared bus settings", cid, a)
				}
			}
			checkProbeCommand(t, cid, c)
		}
	}
}

// identities reads deploy/identities.yaml: name -> role. The creds
// secret is what gpuplane-creds mints from it, one <name>.creds each.
func identities(t *testing.T) map[string]string {
	t.Helper()
	data, err := os.ReadFile("identities.yaml")
	if err != nil {
		t.Fatal(err)
	}
	var d struct {
		Identities []struct {
			Name  string `json:"name"`
			Role  string `json:"role"`
			Scope string `json:"scope"`
		} `json:"identities"`
	}
	if err := yaml.Unmarshal(data, &d); err != nil {
		t.Fatal(err)
	}
	ids := map[string]string{}
	for _, id := range d.Identities {
		ids[id.Name] = id.Role
	}
	return ids
}

// checkListenPort: a service told to listen (-addr) listens on a port its
// container declares, so probes and Services reach it.
func checkListenPort(t *testing.T, cid string, c corev1.Container) {
	t.Helper()
	for _, a := range c.Args {
		addr, ok := strings.CutPrefix(a, "-addr=")
		if !ok {
			continue
		}
		_, port, _ := strings.Cut(addr, ":")
		if !slices.ContainsFunc(c.Ports, func(p corev1.ContainerPort) bool { return strconv.Itoa(int(p.ContainerPort)) == port }) {
			t.Errorf("%s: listens on %s, a port the container does not declare", cid, addr)
		}
		if strings.HasPrefix(addr, "127.") || strings.HasPrefix(addr, "localhost") {
			t.Errorf("%s: listens on loopback only (%s): probes and Services cannot reach it", cid, addr)
		}
	}
}

// checkMounted: path is set and lies in a volume mounted into c; when key
// is set, that volume is a secret projecting key at path's base name.
func checkMounted(t *testing.T, cid string, spec corev1.PodSpec, c corev1.Container, path, key string) {
	t.Helper()
	if path == "" {
		t.Errorf("%s: a bus file (%s) is not set", cid, key)
		return
	}
	for _, m := range c.VolumeMounts {
		rel, err := filepath.Rel(m.MountPath, path)
		if err != nil || strings.HasPrefix(rel, "..") {
			continue
		}
		if key == "" {
			return
		}
		for _, v := range spec.Volumes {
			if v.Name != m.Name || v.Secret == nil {
				continue
			}
			for _, it := range v.Secret.Items {
				if it.Key == key && it.Path == rel {
					return
				}
			}
		}
	}
	t.Errorf("%s: %s is not mounted (want secret key %q there)", cid, path, key)
}

// checkProbeCommand: exec probes run gpuplane-probe (the images have no
// shell) with a subcommand it has.
func checkProbeCommand(t *testing.T, cid string, c corev1.Container) {
	t.Helper()
	for _, p := range []*corev1.Probe{c.ReadinessProbe, c.LivenessProbe} {
		if p == nil || p.Exec == nil {
			continue
		}
		cmd := p.Exec.Command
		if len(cmd) < 2 || cmd[0] != "/usr/local/bin/gpuplane-probe" || (cmd[1] != "bus" && cmd[1] != "running") {
			t.Errorf("%s: exec probe %v is not gpuplane-probe bus|running", cid, cmd)
		}
	}
}

// checkNATS: three servers, one per machine, with the configuration of
// deploy/nats (checked in nats_test.go) mounted, routes to each other,
// and the at-rest key from a secret.
func checkNATS(t *testing.T, r *rendered) {
	t.Helper()
	for _, s := range r.statefulSets {
		if s.Name != "nats" {
			continue
		}
		if *s.Spec.Replicas != 3 {
			t.Errorf("nats: %d servers, want 3", *s.Spec.Replicas)
		}
		if s.Spec.PodManagementPolicy != appsv1.ParallelPodManagement {
			t.Error("nats: servers start one by one; the meta group needs them together")
		}
		c := s.Spec.Template.Spec.Containers[0]
		env := map[string]corev1.EnvVar{}
		for _, e := range c.Env {
			env[e.Name] = e
		}
		for i := range 3 {
			want := fmt.Sprintf("nats-route://nats-%d.%s:6222", i, s.Spec.ServiceName)
			if got := env[fmt.Sprintf("GPUPLANE_NATS_ROUTE_%d", i)].Value; got != want {
				t.Errorf("nats: route %d is %q, want %q", i, got, want)
			}
		}
		if ps := c.Lifecycle; ps == nil || ps.PreStop == nil || ps.PreStop.Exec == nil ||
			!slices.Equal(ps.PreStop.Exec.Command, []string{"/usr/local/bin/nats-server", "--signal", "ldm=1"}) {
			t.Error("nats: no preStop hook putting the server in lame duck mode")
		}
		if g := s.Spec.Template.Spec.TerminationGracePeriodSeconds; g == nil || time.Duration(*g)*time.Second <= lameDuck {
			t.Errorf("nats: termination grace %v does not leave lame duck mode its %v", g, lameDuck)
		}
		if k := env["GPUPLANE_JS_KEY"]; k.ValueFrom == nil || k.ValueFrom.SecretKeyRef == nil {
			t.Error("nats: the JetStream key is not read from a secret")
		}
		cm := r.configMaps[configVolume(s.Spec.Template.Spec, "config")]
		if cm == nil {
			t.Fatal("nats: no configuration ConfigMap mounted")
		}
		want, err := os.ReadFile("nats/nats-server.conf")
		if err != nil {
			t.Fatal(err)
		}
		if cm.Data["nats-server.conf"] != string(want) {
			t.Error("nats: the mounted configuration differs from deploy/nats/nats-server.conf: cp deploy/nats/nats-server.conf deploy/kubernetes/base/")
		}
		return
	}
	t.Error("no nats StatefulSet")
}

func configVolume(spec corev1.PodSpec, name string) string {
	for _, v := range spec.Volumes {
		if v.Name == name && v.ConfigMap != nil {
			return v.ConfigMap.Name
		}
	}
	return ""
}

// checkNodeAgent: the agent runs on GPU machines only, tolerates their
// taint, reads the real GPUs through NVML and keeps its run state on the
// machine.
func checkNodeAgent(t *testing.T, r *rendered) {
	t.Helper()
	for _, d := range r.daemonSets {
		if d.Name != "node-agent" {
			continue
		}
		spec := d.Spec.Template.Spec
		if spec.NodeSelector["nvidia.com/gpu.present"] != "true" {
			t.Error("node-agent: not restricted to GPU machines")
		}
		if !slices.ContainsFunc(spec.Tolerations, func(tl corev1.Toleration) bool { return tl.Key == "nvidia.com/gpu" }) {
			t.Error("node-agent: does not tolerate the nvidia.com/gpu taint")
		}
		// The runs share the machine's network; the bus names must still
		// resolve from it.
		if !spec.HostNetwork || spec.DNSPolicy != corev1.DNSClusterFirstWithHostNet {
			t.Errorf("node-agent: hostNetwork %v with DNS policy %q, want the host's network and ClusterFirstWithHostNet", spec.HostNetwork, spec.DNSPolicy)
		}
		c := spec.Containers[0]
		if !slices.Contains(c.Args, "-backend=nvml") {
			t.Errorf("node-agent: args %v lack -backend=nvml", c.Args)
		}
		hostPaths := map[string]string{}
		for _, v := range spec.Volumes {
			if v.HostPath != nil {
				hostPaths[v.Name] = v.HostPath.Path
			}
		}
		mounted := map[string]bool{}
		for _, m := range c.VolumeMounts {
			mounted[hostPaths[m.Name]] = true
		}
		for _, p := range []string{"/dev", "/var/lib/gpuplane"} {
			if !mounted[p] {
				t.Errorf("node-agent: host %s not mounted", p)
			}
		}
		return
	}
	t.Error("no node-agent DaemonSet")
}
