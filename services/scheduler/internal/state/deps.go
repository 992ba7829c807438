package state

import (
	"fmt"
	"strings"

	"github.com/gpuplane/gpuplane/contracts"
	"github.com/gpuplane/gpuplane/services/scheduler/internal/placement"
)

// Dependencies (dependsOn) form a DAG by construction: a job may only
// depend on jobs its tenant submitted before it, so no request can close a
// cycle (a job naming itself is refused by validation). A request naming a
// job the scheduler does not know (unknown_dependency), or one that was
// rejected (dependency_rejected), is rejected.

// checkDependencies refuses a request whose dependsOn names a job the
// tenant has not submitted (or that was rejected).
func (s *Store) checkDependencies(tenant string, req contracts.JobRequest, streamSeq uint64) error {
	var errs []contracts.FieldError
	for _, d := range req.DependsOn {
		j := s.lookup(tenant, d)
		if j == nil {
			// Requests are answered in parallel: one submitted before
			// this one may still be storing its queued event.
			if seq, ok := s.acceptingJobs[Key(tenant, d)]; ok && seq < streamSeq {
				continue
			}
		}
		switch {
		case j == nil:
			errs = append(errs, contracts.FieldError{Field: "dependsOn", Reason: contracts.ReasonUnknownDependency,
				Message: fmt.Sprintf("job %q of tenant %s is unknown: a job may depend only on jobs submitted before it (which also rules out cycles)", d, tenant)})
		case j.State == contracts.StateRejected:
			// Known, and never to run: say why rather than "unknown".
			why := ""
			if j.rejection != nil {
				why = " (" + string(j.rejection.reason) + ")"
			}
			errs = append(errs, contracts.FieldError{Field: "dependsOn", Reason: contracts.ReasonDependencyRejected,
				Message: fmt.Sprintf("job %q of tenant %s was rejected%s and will never run; resubmit it under a new ID and depend on that", d, tenant, why)})
		}
	}
	if len(errs) == 0 {
		return nil
	}
	reason := errs[0].Reason
	for _, e := range errs[1:] {
		if e.Reason != reason {
			reason = contracts.ReasonInvalidRequest
		}
	}
	return &contracts.ValidationError{Reason: reason, Fields: errs}
}

// depVerdict says whether j may be placed now: ready, waiting (with the
// pending reason), or doomed (a dependency failed: j is cancelled).
type depVerdict int

const (
	depReady depVerdict = iota
	depWaiting
	depFailed
)

// dependencies checks j's dependsOn against the jobs' current states.
func (s *Store) dependencies(j *Job) (depVerdict, placement.Pending) {
	if len(j.Request.DependsOn) == 0 {
		return depReady, placement.Pending{}
	}
	var waiting []string
	for _, d := range j.Request.DependsOn {
		dep := s.lookup(j.Tenant, d)
		switch {
		case dep == nil:
			// Submit accepted it while the dependency's request was being
			// answered; that answer failed to publish and the request
			// comes again (or a stream was edited by hand). Waiting is
			// safe; cancelling would be wrong once it is queued. A store
			// that forgets asks the scheduler to read it back (pins
			// should have kept it: TakeMissing).
			waiting = append(waiting, d+" (not recorded yet)")
			if s.Forgetting() {
				if s.missing == nil {
					s.missing = map[string]struct{}{}
				}
				s.missing[Key(j.Tenant, d)] = struct{}{}
			}
		case dep.State == contracts.StateSucceeded:
		case dep.State == contracts.StateFailed, dep.State == contracts.StateCancelled, dep.State == contracts.StateRejected:
			return depFailed, placement.Pending{Code: contracts.ReasonDependencyFailed,
				Message: fmt.Sprintf("dependency %s ended %s; this job cannot run", d, dep.State)}
		default:
			waiting = append(waiting, d+" ("+string(dep.State)+")")
		}
	}
	if len(waiting) == 0 {
		return depReady, placement.Pending{}
	}
	return depWaiting, placement.Pending{Code: contracts.PendingDependencies,
		Message: "waiting for " + strings.Join(waiting, ", ") + " to succeed"}
}

// failDependent cancels a queued job whose dependency failed.
func (s *Store) failDependent(j *Job, why placement.Pending) {
	if s.emit(j, contracts.EventCancelled, 0, func(ev *contracts.JobEvent) {
		ev.Reason, ev.Message = contracts.ReasonDependencyFailed, why.Message
	}) {
		s.finish(j)
		s.cfg.Wake()
	}
}
