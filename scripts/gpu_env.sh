# Setup that only the project's own GPU hosts need, sourced by the scripts/gpu_*.sh runners (through
# scripts/gpu_common.sh) and by nothing else. A user's GPU machine needs none of it: `make install` (or the pinned
# requirements.txt in any environment) is the whole setup there.
#
# Those hosts have no package index: the pinned requirements they lack travel with the checkout as wheels in .whl/
# (ignored by git), installed here into a private site directory that PYTHONPATH puts first. Installed once per
# machine: runners sourced one after another in one call share it.
if compgen -G ".whl/*.whl" >/dev/null; then
  [ -f /tmp/site/.installed ] || {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      && touch /tmp/site/.installed
  }
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
