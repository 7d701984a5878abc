# Sourced by the device scripts, from the repository root: $OUT (made), the wheels the device image
# lacks (.whl/, carried) on PYTHONPATH, kvpool installed in editable mode, unbuffered Python output.
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site || exit 1
python3 -m pip install -q -e . --no-deps --no-build-isolation || exit 1
export PYTHONUNBUFFERED=1
