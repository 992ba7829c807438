#!/bin/bash
# Real-GPU check of issue 12's bus identities: the all-in-one (auth on) and a
# standalone node agent on this machine's NVIDIA GPU with a least-privilege
# node identity minted by gpuplane-creds; a tenant job runs on the GPU.
# Build here and carry the folder to the GPU machine (it has no Go):
#   d=.gpuplane/gpucarry; mkdir -p $d
#   for c in gpuplane/cmd/gpuplane gpuplane/cmd/gpuplane-creds node-agent/cmd/node-agent gpuctl/cmd/gpuctl; do
#     go build -trimpath -ldflags="-s -w" -o $d/ ./services/$c; done; gzip -f $d/*; cp e2e/realgpu/node-identity.sh $d/
#   there: bash .gpuplane/gpucarry/node-identity.sh      (BACKEND=sim runs it on a machine without a GPU)
set -u
BACKEND=${BACKEND:-nvml}
cd "$(dirname "$0")"
for f in *.gz; do [ -e "$f" ] && gunzip -f "$f"; done
chmod +x gpuplane gpuplane-creds node-agent gpuctl
export HOME=$(mktemp -d) XDG_CONFIG_HOME=
D=$(mktemp -d)
./gpuplane -data $D -nats-port 4299 -gateway-addr 127.0.0.1:8299 -metrics-addr 127.0.0.1:9299 > $D/gp.log 2>&1 &
GP=$!
for i in $(seq 60); do grep -q "gpuplane is up" $D/gp.log && break; sleep 0.5; done
grep -A3 "gpuplane is up" $D/gp.log
./gpuplane-creds -trust $D/trust -out $D/nodecreds -node real-gpu-01 >/dev/null || echo "creds failed"
GPUPLANE_NATS_URL=nats://127.0.0.1:4299 GPUPLANE_NATS_CREDS=$D/nodecreds/node-real-gpu-01.creds \
  ./node-agent -backend $BACKEND -node-id real-gpu-01 -pool real -gpu-model H200-141GB -gpu-count 1 -log-dir $D/agent > $D/agent.log 2>&1 &
AG=$!
sleep 4
export GPUPLANE_GATEWAY=http://127.0.0.1:8299
./gpuctl whoami
./gpuctl nodes real-gpu-01 2>&1 | head -12
./gpuctl submit --tenant acme --id h200-probe --gpus 1 --model H200-141GB -- sh -c 'echo "visible: $CUDA_VISIBLE_DEVICES"; nvidia-smi -L; nvidia-smi --query-gpu=name,uuid,memory.total --format=csv'
timeout 60 ./gpuctl watch --tenant acme h200-probe
./gpuctl logs --tenant acme h200-probe 2>&1 | head -20
echo "== refusals and errors in the logs (want none):"
grep -ci "violation\|refused access" $D/gp.log $D/agent.log
grep -i "level=error" $D/agent.log | head -5
kill $AG $GP; wait
