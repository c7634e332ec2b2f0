# Sourced by a device call's run script from the repository root (bash bench/records/sNN/runK.sh):
# the carried wheels (.whl/, the cuDNN frontend) into /tmp/site on PYTHONPATH, then this tree
# installed editable, each failure said on stdout rather than stopping the call.
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
export PYTHONPATH=/tmp/site
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 || echo "install failed"
