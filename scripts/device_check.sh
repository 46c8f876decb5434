#!/usr/bin/env bash
# Every GPU check of hookexp in one command, for a lent GPU machine that has torch but no internet: installs the
# missing packages from wheels carried in .whl/, then (each phase time-boxed; a failing phase never stops the
# next one) a profile of a GPT-2-small step, the CUDA tests, the GPT-2-small overhead benchmark on the GPU, the
# watch()-vs-wandb.watch cases on the small gpt, and, with the time left, the rest of the suite on the GPU. Logs and
# step times go to $OUT.
#
#   bash scripts/device_check.sh          # on the GPU machine, from the repository root, with .whl carried
#
# .whl/ (not committed: add /.whl/ to .git/info/exclude) holds cp312 manylinux x86_64 or pure wheels of what the
# machine lacks, at the versions .venv has: hydra-core omegaconf antlr4-python3-runtime orjson mup wandb and
# wandb's requirements (annotated-types cwevals distro googleapis-common-protos opentelemetry-api
# opentelemetry-exporter-http-transport opentelemetry-exporter-otlp-common opentelemetry-exporter-otlp-proto-common
# opentelemetry-exporter-otlp-proto-http opentelemetry-proto opentelemetry-sdk opentelemetry-semantic-conventions
# platformdirs pydantic pydantic-core sniffio typing-inspection); .whl/fallback/ holds protobuf and
# typing_extensions, installed only where the machine's own do not satisfy the other wheels' requirements. Made by
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl NAME==V
#   python -m pip wheel --no-deps antlr4-python3-runtime==4.9.3 mup==1.0.0 -w .whl     # sdists only: pure wheels
# W&B runs offline. Environment: OUT (default /tmp/device_check), DEADLINE (seconds from the start that the last
# phase must end by, default 430), PY (default python3), BENCH_CASES, BENCH_STEPS, BENCH_REPEATS, BENCH_LIMIT (the
# main benchmark's --cases, --steps, --repeats and --time-limit; BENCH_S its seconds), COMPILED_CASES and COMPILED_S
# (the compiled benchmark's cases, '' for none, and seconds), TESTS_S (the CUDA tests' seconds), SKIP_TESTS=1 (no
# CUDA tests), SKIP_GPT=1 (no small gpt phase), SKIP_SUITE=1 (no last phase). The first phase after the install,
# benchmarks/profile_step.py on gpt2_124m (where a step's GPU time goes, by case; $OUT/profile.tar holds its tables,
# per-step values and chrome traces): PROFILE_CASES (default b,c; '' for none), PROFILE_STEPS (profiled steps, default
# 8), PROFILE_S (its seconds, default 120), PROFILE_COMPILED=1 (again under trainer.compile=true, PROFILE_COMPILED_S
# seconds, default 150), SKIP_PROFILE=1 (no profile phase).
set -u
start=$SECONDS
OUT="${OUT:-/tmp/device_check}"
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device_check.log") 2>&1
DEADLINE="${DEADLINE:-430}"
PY="${PY:-python3}"
export PYTHONUNBUFFERED=1 WANDB_MODE=offline WANDB_SILENT=true WANDB_DIR=/tmp/wandb WANDB_CACHE_DIR=/tmp/wandb/cache \
    WANDB_CONFIG_DIR=/tmp/wandb/config WANDB_DATA_DIR=/tmp/wandb/data WANDB_DISABLE_GIT=true HYDRA_FULL_ERROR=1
mkdir -p /tmp/wandb
status=()
phase() { echo; echo "=== [$((SECONDS - start)) s] $*"; }
left() { echo $((DEADLINE - (SECONDS - start))); }
note() { status+=("$1: rc=$2 ($((SECONDS - t0)) s)"); echo "--- $1: rc=$2 ($((SECONDS - t0)) s)"; }

phase "install the carried wheels"
t0=$SECONDS
site=/tmp/site
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
rc=$?
# fallbacks (.whl/fallback): a newer protobuf / typing_extensions only where the machine's do not satisfy what the
# installed wheels require (googleapis-common-protos: protobuf>=6.33.5; pydantic: typing-extensions>=4.16)
need=$($PY - "$site" <<'EOF'
import importlib.metadata as md, pathlib, sys
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name as cn
site = sys.argv[1]
fallback = {cn(w.name.split("-")[0]): w for w in pathlib.Path(".whl/fallback").glob("*.whl")}
def version(name):
    for d in [*md.distributions(path=[site]), *md.distributions()]:
        if cn(d.metadata["Name"]) == name:
            return d.version
    return None
wanted = set()
for d in md.distributions(path=[site]):
    for r in map(Requirement, d.requires or []):
        if r.marker and not r.marker.evaluate({"extra": ""}):
            continue
        have = version(cn(r.name))
        if have is None or not r.specifier.contains(have, prereleases=True):
            if cn(r.name) in fallback:
                wanted.add(str(fallback[cn(r.name)]))
            else:
                print(f"UNMET: {d.metadata['Name']} needs {r} (have {have})", file=sys.stderr)
print(" ".join(sorted(wanted)))
EOF
)
if [ -n "$need" ]; then
    echo "fallback wheels: $need"
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" $need || rc=$?
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
# hookexp itself, editable (its configs live in conf/, installed as the package hookexp.conf)
if ! $PY -m pip install -q --no-index --no-deps --no-build-isolation -e . >"$OUT/install_hookexp.log" 2>&1; then
    echo "editable install failed (see install_hookexp.log): linking hookexp/conf -> ../conf instead"
    ln -sfn ../conf hookexp/conf
    export PYTHONPATH="$PWD:$PYTHONPATH"
fi
$PY -c "import hydra, omegaconf, wandb, orjson, pydantic, google.protobuf as pb, typing_extensions, hookexp.conf, mup
print('imports ok: hydra', hydra.__version__, 'omegaconf', omegaconf.__version__, 'wandb', wandb.__version__,
      'pydantic', pydantic.VERSION, 'protobuf', pb.__version__)" || rc=$?
note install $rc

phase "profile: where a gpt2_124m step's time goes, cases ${PROFILE_CASES-b,c} (compiled too: PROFILE_COMPILED=1)"
t0=$SECONDS
pcases="${PROFILE_CASES-b,c}"  # c - b: the statistics every step; the table splits it (benchmarks/profile_step.py)
if [ "${SKIP_PROFILE:-0}" != 1 ] && [ -n "$pcases" ]; then
    mkdir -p "$OUT/profile"
    timeout -s USR1 -k 20 "${PROFILE_S:-120}" $PY benchmarks/profile_step.py --device cuda --models gpt2_124m \
        --cases "$pcases" --steps "${PROFILE_STEPS:-8}" --warmup-steps 10 --trace "$OUT/profile/eager" 2>&1 \
        | tee "$OUT/profile/eager.log"
    note profile-gpt2_124m "${PIPESTATUS[0]}"
    if [ "${PROFILE_COMPILED:-0}" = 1 ]; then
        t0=$SECONDS
        timeout -s USR1 -k 20 "${PROFILE_COMPILED_S:-150}" $PY benchmarks/profile_step.py --device cuda \
            --models gpt2_124m --cases "$pcases" --steps "${PROFILE_STEPS:-8}" --warmup-steps 10 \
            --set trainer.compile=true --trace "$OUT/profile/compiled" 2>&1 | tee "$OUT/profile/compiled.log"
        note profile-gpt2_124m-compiled "${PIPESTATUS[0]}"
    fi
    # one file back (a lent machine returns at most 8): the tables, every step's values, the chrome traces
    tar -cf "$OUT/profile.tar" -C "$OUT" profile && rm -rf "$OUT/profile"
else
    note profile-gpt2_124m skipped
fi

phase "the machine"
t0=$SECONDS
nvidia-smi -L
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader
$PY -c "import torch, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda,
      'available', torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
nproc
note machine $?

phase "CUDA tests: every test whose id names cuda (tests/run/test_cuda.py, the cuda-parametrised ones)"
t0=$SECONDS
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    timeout -k 10 "${TESTS_S:-150}" $PY -m pytest -q -p no:cacheprovider -m 'not slow' -k cuda -rs tests \
        --junitxml="$OUT/cuda_tests.xml" 2>&1 | tee "$OUT/cuda_tests.log" | tail -40
    note cuda-tests "${PIPESTATUS[0]}"
else
    note cuda-tests skipped
fi

phase "overhead benchmark: gpt2_124m (bf16, batch 8 x 1024) on the GPU, eager"
t0=$SECONDS
cases="${BENCH_CASES-a,b,b_nofx,c,d0,d,a_wb,w,e,a_fsdp,b_fsdp,d_fsdp,b2,gns}"  # d0: the shipped stats; b_fsdp/a_fsdp: the price under FSDP
ccases="${COMPILED_CASES-a,b_nofx,b,d0,c,a_fsdp,b_fsdp}"  # the same under trainer.compile=true ('' : none)
budget="${BENCH_S:-$(( $(left) - 110 - (${#ccases} > 0 ? ${COMPILED_S:-150} : 0) ))}"  # the small gpt's and compiled
limit="${BENCH_LIMIT:-$(( budget - 25 ))}"  # no repeat starts that would end after it
if [ -n "$cases" ]; then
    timeout -s USR1 -k 20 $(( budget > 60 ? budget : 60 )) $PY benchmarks/overhead.py --device cuda --models gpt2_124m \
        --cases "$cases" --steps "${BENCH_STEPS:-40}" --warmup-steps 8 --repeats "${BENCH_REPEATS:-3}" \
        --time-limit "$limit" --json "$OUT/bench_gpt2_124m.json" 2>&1 | tee "$OUT/bench_gpt2_124m.log"
    note bench-gpt2_124m "${PIPESTATUS[0]}"
else
    note bench-gpt2_124m skipped
fi

phase "overhead benchmark: gpt2_124m under torch.compile (trainer.compile=true; the hand loops compile the same)"
t0=$SECONDS
if [ -n "$ccases" ]; then
    budget="${COMPILED_S:-150}"
    timeout -s USR1 -k 20 "$budget" $PY benchmarks/overhead.py --device cuda --models gpt2_124m --cases "$ccases" \
        --steps "${BENCH_STEPS:-40}" --warmup-steps 8 --repeats "${BENCH_REPEATS:-3}" --time-limit $(( budget - 25 )) \
        --set trainer.compile=true --json "$OUT/bench_gpt2_124m_compiled.json" 2>&1 | tee "$OUT/bench_gpt2_124m_compiled.log"
    note bench-gpt2_124m-compiled "${PIPESTATUS[0]}"
else
    note bench-gpt2_124m-compiled skipped
fi

phase "overhead benchmark: watch() vs wandb.watch on the issue's gpt (d_model 256, 4 blocks) on the GPU"
t0=$SECONDS
if [ "${SKIP_GPT:-0}" != 1 ] && [ "$(left)" -gt 45 ]; then
    timeout -s USR1 -k 20 $(( $(left) > 100 ? 100 : $(left) - 5 )) $PY benchmarks/overhead.py --device cuda --models gpt \
        --cases a,b,a_wb,w,e --repeats 3 --time-limit 60 --json "$OUT/bench_gpt.json" 2>&1 | tee "$OUT/bench_gpt.log"
    note bench-gpt "${PIPESTATUS[0]}"
else
    note bench-gpt skipped
fi

phase "the rest of the suite on the GPU (trainer.device=auto picks CUDA), with the time left"
t0=$SECONDS
if [ "${SKIP_SUITE:-0}" != 1 ] && [ "$(left)" -gt 40 ]; then
    timeout -k 10 $(( $(left) - 10 )) $PY -m pytest -q -p no:cacheprovider -m 'not slow' -n 8 --maxfail=30 -k 'not cuda' \
        tests/run tests/telemetry tests/engine 2>&1 | tee "$OUT/suite.log" | tail -25
    rc=${PIPESTATUS[0]}
    note suite "$rc$([ "$rc" = 124 ] && echo ', cut at the deadline')"
else
    note suite skipped
fi

phase "summary"
printf '%s\n' "${status[@]}"
grep -h "FAILED (" "$OUT"/bench_*.log 2>/dev/null
tar -xOf "$OUT/profile.tar" --wildcards 'profile/*/profile_*.md' 2>/dev/null
for f in "$OUT"/bench_*.log; do
    [ -f "$f" ] && { echo "--- $f"; sed -n '/^torch /,$p' "$f"; }
done
echo "total $((SECONDS - start)) s"
sleep 1  # tee's last lines into $OUT/device_check.log
