package fragsim

import (
	"path/filepath"
	"strings"
)

// Published holds the FGD paper's released results on the openb pod lists
// (alibaba/clusterdata, cluster-trace-gpu-v2023): unallocated GPU % by pod
// list, policy (a PolicyNames entry) and arrived percentage, median of 10
// seeds. Only what the release states is here.
var Published = map[string]map[string]map[float64]float64{
	"default": {
		"random": {100: 13.75}, "dotprod": {100: 9.44}, "packing": {100: 8.19}, "bestfit": {100: 7.09},
		"fgd": {95: 5.09, 100: 4.77, 110: 4.68, 130: 4.60},
	},
	"cpu050": {
		"random": {100: 11.02}, "dotprod": {100: 6.94}, "packing": {100: 6.47}, "bestfit": {100: 6.42}, "fgd": {100: 5.00},
	},
	"cpu100": {
		"random": {100: 12.56}, "dotprod": {100: 8.22}, "packing": {100: 7.44}, "bestfit": {100: 6.72}, "fgd": {100: 4.79},
	},
	"gpuspec10": {
		"random": {100: 13.69}, "dotprod": {100: 9.75}, "packing": {100: 7.77}, "bestfit": {100: 6.88}, "fgd": {100: 5.30},
	},
	"multigpu20": {
		"random": {100: 13.16}, "dotprod": {100: 8.19}, "packing": {100: 6.49}, "bestfit": {100: 6.27}, "fgd": {100: 4.47},
	},
}

// ListName is the short name of a pod list file: "default" for
// openb_pod_list_default.csv.
func ListName(path string) string {
	base := strings.TrimSuffix(filepath.Base(path), filepath.Ext(path))
	return strings.TrimPrefix(base, "openb_pod_list_")
}
