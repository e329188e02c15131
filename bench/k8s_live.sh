#!/usr/bin/env bash
# The whole Kubernetes path on a live cluster, each step timed: render with --planner-acts,
# apply, wait until every Deployment and StatefulSet is ready, one completion through the edge
# (Envoy, reached by `kubectl port-forward`), the planner's RBAC checked (`kubectl auth can-i`
# as its ServiceAccount), scale decode up by one and drain one decode pod through the planner's
# actuator (`distserve deploy act`: the same calls the acting planner makes in the cluster,
# here from this machine's kubeconfig), then delete the namespace.
#
# For a machine where kubectl reaches a cluster that can pull $IMAGE (`make image`, pushed);
# where `kubectl cluster-info` fails it says so and exits 0. A CPU mesh by default:
#   MODEL=facebook/opt-125m  the Hub id every pod stages (`distserve model fetch`)
#   IMAGE=distserve-mesh:<version>  NS=distserve-live  DEVICE=cpu  PLAN=<a 1P1D plan it writes>
#   READY_TIMEOUT=20m
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD"
PY="${PYTHON:-python3}"
NS="${NS:-distserve-live}"
MODEL="${MODEL:-facebook/opt-125m}"
DEVICE="${DEVICE:-cpu}"
READY_TIMEOUT="${READY_TIMEOUT:-20m}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT

if ! kubectl cluster-info >/dev/null 2>&1; then
  echo "k8s_live: kubectl reaches no cluster here (kubectl cluster-info failed): nothing to run"
  exit 0
fi

step() {  # step NAME COMMAND...: run it, print its wall time; stop the run if it fails
  local name="$1"; shift
  local t0; t0=$(date +%s.%N)
  if ! "$@"; then
    echo "k8s_live: step '$name' failed"
    cleanup
    exit 1
  fi
  awk -v n="$name" -v t0="$t0" -v t1="$(date +%s.%N)" \
    'BEGIN { printf "k8s_live: %-12s %7.1f s\n", n, t1 - t0 }'
}

cleanup() { kubectl delete namespace "$NS" --wait=true --timeout=5m >/dev/null 2>&1; }

render() {
  if [ -z "${PLAN:-}" ]; then  # one prefill and one decode instance on a node of 2 devices
    PLAN="$WORK/plan.json"
    cat >"$PLAN" <<JSON
{"model": "$MODEL", "cluster": {"nodes": 1, "gpus_per_node": 2},
 "slo_ms": {"ttft": 2000, "tpot": 500},
 "placement": {"algorithm": "high-affinity", "instances": [
   {"role": "prefill", "tp": 1, "pp": 1, "stages": [{"node": 0, "gpus": [0]}]},
   {"role": "decode", "tp": 1, "pp": 1, "stages": [{"node": 0, "gpus": [1]}]}]}}
JSON
  fi
  "$PY" -m distserve.cli model fetch "$MODEL" --tokenizer-only --to "$WORK/spec" >/dev/null &&
    "$PY" -m distserve.cli deploy render --placement "$PLAN" --out "$WORK/k8s" --planner-acts \
      --namespace "$NS" --device "$DEVICE" --model "$MODEL" --model-spec "$WORK/spec" \
      ${IMAGE:+--image "$IMAGE"} >/dev/null
}

ready() {
  kubectl -n "$NS" wait --for=condition=Available deployment --all --timeout="$READY_TIMEOUT" &&
    for sts in distserve-etcd distserve-planner; do
      kubectl -n "$NS" rollout status "statefulset/$sts" --timeout="$READY_TIMEOUT" || return 1
    done
}

complete() {
  kubectl -n "$NS" port-forward svc/distserve-envoy 18080:8080 >"$WORK/pf.log" 2>&1 &
  local pf=$!
  sleep 3
  local name
  name=$(curl -sf http://127.0.0.1:18080/v1/models | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["data"][0]["id"])')
  curl -sf http://127.0.0.1:18080/v1/completions -H 'Content-Type: application/json' \
    -d "{\"model\": \"$name\", \"prompt\": \"The capital of France is\", \"max_tokens\": 8}"
  local rc=$?
  echo
  kill "$pf"
  return $rc
}

rbac() {  # what the planner's ServiceAccount may do, and may not
  local as="system:serviceaccount:$NS:distserve-planner"
  kubectl -n "$NS" auth can-i patch deployments.apps --subresource=scale --as "$as" &&
    kubectl -n "$NS" auth can-i patch pods --as "$as" &&
    ! kubectl -n "$NS" auth can-i delete pods --as "$as" &&
    ! kubectl -n "$NS" auth can-i get secrets --as "$as"
}

act() { "$PY" -m distserve.cli deploy act --namespace "$NS" "$@"; }

settled() {  # until the actuator's status says the change has landed
  for _ in $(seq 600); do
    act status | tail -1 | grep -q settled && { act status | tail -1; return 0; }
    sleep 2
  done
  return 1
}

scale_up() { act scale decode 2 >/dev/null && settled; }

drain() {
  local pod
  pod=$(kubectl -n "$NS" get pods -l app.kubernetes.io/component=decode \
    --sort-by=.metadata.creationTimestamp -o jsonpath='{.items[0].metadata.name}')
  echo "draining $pod (the oldest decode pod: not the one the ReplicaSet would pick)"
  act drain "$pod" | tail -1 && ! kubectl -n "$NS" get pod "$pod" >/dev/null 2>&1
}

kubectl version 2>/dev/null | head -2
step render render
step apply kubectl apply -k "$WORK/k8s"
step ready ready
step completion complete
step rbac rbac
step scale-up scale_up
step drain drain
step cleanup cleanup
