# Sourced by nixl-compare.sh and control-compare.sh: the throwaway NIXL venv
# ($NIXL_VENV, default /tmp/ferry-nixl-venv; nixl-cu12 $NIXL_VERSION, default 1.5.1,
# without dependencies, plus numpy) and FERRY_UCX_LIBRARY pointed at the wheel's libucp,
# so Ferry loads the same UCX build as NIXL. Sets $venv.
venv="${NIXL_VENV:-/tmp/ferry-nixl-venv}"
nixl_version="${NIXL_VERSION:-1.5.1}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install -q --no-deps "nixl-cu12==$nixl_version"
  "$venv/bin/pip" install -q numpy
fi
site="$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
lib="$(ls "$site"/nixl_cu12.libs/libucp-*.so* 2>/dev/null | head -1)"
[ -n "$lib" ] || { echo "no libucp in $site/nixl_cu12.libs" >&2; exit 1; }
export FERRY_UCX_LIBRARY="$lib"
echo "libucp: $lib" >&2
