package mps

// GaveUp reports whether the keeper of the GPU stopped restarting its
// daemon (MaxRestarts failures in a row).
func (s *Supervisor) GaveUp(gpuUUID string) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	g := s.gpus[gpuUUID]
	return g != nil && g.gaveUp
}
