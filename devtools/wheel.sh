#!/usr/bin/env bash
# A wheel of the ferry package for one CPython (>= 3.9, with its headers):
#   tools/dev.sh wheel [--python PY|auto] [-c opt|fastbuild] [--check]
# writes dist/ferry-<version>-cp3XY-cp3XY-linux_x86_64.whl. PY defaults to
# Debian's /usr/bin/python3; a pyenv or venv interpreter works as well.
# "auto" takes a Python that is not Debian's where there is one (a pyenv
# version, /usr/local/bin, another python3 on PATH), else Debian's.
#
# How: Bazel builds libferry.so (the C API and everything under it); the
# extension is compiled here against PY's headers and linked to it; the
# shared libraries libferry.so needs that a base Debian system lacks
# (abseil, gRPC, protobuf, rdma-core's libibverbs, ...) go into
# ferry/.libs, found through $ORIGIN run paths set with patchelf, as
# auditwheel does. The C and C++ runtimes and glibc are the system's.
#
# --check then installs the wheel into a fresh venv of PY, with no index
# (nothing is downloaded), and runs python/tests there against it, on
# softrnic and softgpu as //python:python_test does.
set -euo pipefail
cd "$(dirname "$0")/.."

py=/usr/bin/python3
mode=opt
check=0
while (($#)); do
  case "$1" in
    --python) py="$2"; shift 2 ;;
    -c) mode="$2"; shift 2 ;;
    --check) check=1; shift ;;
    *) echo "usage: tools/dev.sh wheel [--python PY] [-c opt|fastbuild] [--check]" >&2; exit 2 ;;
  esac
done

if [[ "$py" == auto ]]; then
  py=/usr/bin/python3
  for c in "$(command -v python3 || true)" "$HOME"/.pyenv/versions/*/bin/python3 \
    /usr/local/bin/python3.[0-9]*; do
    [[ -x "$c" ]] || continue
    # The interpreter itself, not a shim or a venv's link to it.
    real="$("$c" -c 'import os, sys
if sys.version_info >= (3, 9): print(os.path.realpath(sys.executable))' 2>/dev/null || true)"
    [[ -n "$real" && "$real" != /usr/bin/python3* ]] || continue
    py="$real"
    break
  done
  echo "wheel: for $py" >&2
fi

read -r tag suffix include version < <("$py" - <<'EOF'
import sys, sysconfig
if sys.version_info < (3, 9):
    sys.exit("ferry needs CPython 3.9 or later, not " + sys.version.split()[0])
print("cp%d%d" % sys.version_info[:2], sysconfig.get_config_var("EXT_SUFFIX"),
      sysconfig.get_paths()["include"], sys.version.split()[0])
EOF
)
if [[ ! -f "$include/Python.h" ]]; then
  echo "error: $py ($version) has no Python.h in $include: install its" \
    "headers (Debian: python3-dev; pyenv builds have them)" >&2
  exit 1
fi
ferry_version="$(sed -n 's/^__version__ = "\(.*\)"$/\1/p' python/ferry/__init__.py)"
[[ -n "$ferry_version" ]] || { echo "error: no __version__ in python/ferry/__init__.py" >&2; exit 1; }

bazel build -c "$mode" //engine/capi:libferry.so >&2
lib="$(bazel info -c "$mode" bazel-bin 2>/dev/null)/engine/capi/libferry.so"

work="$(mktemp -d /tmp/ferry-wheel.XXXXXX)"
trap 'rm -rf "$work"' EXIT
pkg="$work/ferry"
mkdir -p "$pkg/.libs"
cp python/ferry/*.py python/ferry/*.pyi python/ferry/py.typed "$pkg/"
install -m 0755 "$lib" "$pkg/.libs/libferry.so"
# Bazel gives it no soname, so that the extension would record the path
# it was linked from: the name alone, found by the run path.
patchelf --set-soname libferry.so "$pkg/.libs/libferry.so"

# What libferry.so loads, less what every Linux system has (auditwheel's
# rule): glibc's libraries, the loader, and the C and C++ runtimes.
# The system's libraries, not those a development shell put first.
deps="$(env -u LD_LIBRARY_PATH ldd "$lib")"
if grep -q "not found" <<<"$deps"; then
  echo "error: libferry.so needs libraries this host lacks:" >&2
  grep "not found" <<<"$deps" >&2
  exit 1
fi
awk '$2 == "=>" && $3 ~ /^\// {print $1, $3}' <<<"$deps" |
  while read -r name path; do
    case "$name" in
      libc.so.* | libm.so.* | libdl.so.* | librt.so.* | libpthread.so.* | \
        ld-linux*.so.* | libstdc++.so.* | libgcc_s.so.*) continue ;;
    esac
    install -m 0755 "$(readlink -f "$path")" "$pkg/.libs/$name"
  done
# shellcheck disable=SC2016  # $ORIGIN is the loader's, not the shell's.
for f in "$pkg"/.libs/*.so*; do patchelf --set-rpath '$ORIGIN' "$f"; done

# The extension, against PY's headers and pybind11's (Debian's).
# shellcheck disable=SC2016
g++ -std=c++17 -O2 -fPIC -shared -fvisibility=hidden \
  -I "$include" -I include -I . python/ferry_module.cc \
  "$pkg/.libs/libferry.so" -Wl,-rpath,'$ORIGIN/.libs' \
  -o "$pkg/_ferry$suffix"

mkdir -p dist
whl="dist/ferry-$ferry_version-$tag-$tag-linux_x86_64.whl"
"$py" - "$work" "$whl" "$ferry_version" "$tag" <<'EOF'
import base64, hashlib, os, sys, zipfile
work, whl, version, tag = sys.argv[1:]
info = f"ferry-{version}.dist-info"
meta = {
    f"{info}/METADATA": (
        "Metadata-Version: 2.1\nName: ferry\n"
        f"Version: {version}\n"
        "Summary: Ferry, an RDMA transfer engine for KV-cache migration, "
        "with a Mooncake TE-compatible API (ferry.mooncake)\n"
        "Requires-Python: >=3.9\n"),
    f"{info}/WHEEL": (
        "Wheel-Version: 1.0\nGenerator: ferry devtools/wheel.sh\n"
        f"Root-Is-Purelib: false\nTag: {tag}-{tag}-linux_x86_64\n"),
    f"{info}/top_level.txt": "ferry\n",
}
record = []
def digest(data):
    h = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
    return "sha256=" + h.decode()
with zipfile.ZipFile(whl, "w", zipfile.ZIP_DEFLATED) as z:
    for root, _, files in os.walk(os.path.join(work, "ferry")):
        for f in sorted(files):
            path = os.path.join(root, f)
            arc = os.path.relpath(path, work)
            data = open(path, "rb").read()
            info_ = zipfile.ZipInfo(arc)
            info_.external_attr = (os.stat(path).st_mode & 0o777) << 16
            info_.compress_type = zipfile.ZIP_DEFLATED
            z.writestr(info_, data)
            record.append(f"{arc},{digest(data)},{len(data)}")
    for arc, text in meta.items():
        data = text.encode()
        z.writestr(arc, data)
        record.append(f"{arc},{digest(data)},{len(data)}")
    record.append(f"{info}/RECORD,,")
    z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
EOF
echo "wheel: $whl ($(du -h "$whl" | cut -f1), for $py $version)"
# Gone before anything is checked: nothing may load from where it was made.
rm -rf "$pkg"

((check)) || exit 0
# A fresh venv of PY, the wheel installed with no index, the tests run
# there (pytest and numpy come from the system, as --system-site-packages
# gives them: the wheel itself is what is tested).
venv="$work/venv"
"$py" -m venv --system-site-packages "$venv"
"$venv/bin/python" -m pip install -q --no-index --no-deps "$whl"
tests="$work/tests"
testpath="$tests"
# pytest (and numpy) for an interpreter that has none: Debian's, which are
# pure Python or built for the same CPython version's ABI. They are the
# test harness, not what is tested.
if ! "$venv/bin/python" -c 'import pytest' 2>/dev/null; then
  testpath="$tests:/usr/lib/python3/dist-packages"
fi
mkdir -p "$tests/mooncake"
cp python/tests/*.py "$tests/"
cp python/mooncake/*.py "$tests/mooncake/"
bin="$(bazel info -c "$mode" bazel-bin 2>/dev/null)"
bazel build -c "$mode" //transport/softrnic:libibverbs.so.1 //gpu/softgpu:libcuda.so.1 >&2
mkdir -p "$work/run"  # Not $work, whose ferry/ would shadow the venv's.
set +e  # A failing test must still get its count printed below.
(
  cd "$work/run"
  FERRY_SOFTGPU_DEVICES=2 \
    LD_LIBRARY_PATH="$bin/transport/softrnic:$bin/gpu/softgpu" \
    PYTHONPATH="$testpath" timeout 300 "$venv/bin/python" -c '
import ferry, sys
here = ferry.__file__
assert "/venv/" in here, "ferry imported from " + here + ", not the venv"
print("ferry", ferry.__version__, "from", here)
' && FERRY_SOFTGPU_DEVICES=2 \
    LD_LIBRARY_PATH="$bin/transport/softrnic:$bin/gpu/softgpu" \
    PYTHONPATH="$testpath" timeout 300 "$venv/bin/python" -m pytest -q \
    -p no:cacheprovider "$tests"
) | tee "$work/pytest.out"
rc=${PIPESTATUS[0]}
set -e
# The count .ci/run adds up: pytest's, or one failure if it never ran.
summary="$(tail -1 "$work/pytest.out")"
passed="$(grep -oE '[0-9]+ passed' <<<"$summary" | cut -d' ' -f1 || true)"
failed=0
for n in $(grep -oE '[0-9]+ (failed|errors?)' <<<"$summary" | cut -d' ' -f1); do
  failed=$((failed + n))
done
((rc == 0 || failed > 0)) || failed=1
((rc == 0)) || echo "failing: the wheel's Python tests ($py)"
echo "${passed:-0} passed, $failed failed"
exit "$rc"
