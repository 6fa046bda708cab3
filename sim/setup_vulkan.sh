#!/usr/bin/env bash
# Install a CPU Vulkan driver that SAPIEN / ManiSkill 3 can render with, without touching the
# system's Mesa or apt sources.
#
# SAPIEN needs a Vulkan device with descriptorBindingPartiallyBound. Debian bookworm's Mesa 22
# lavapipe lacks it ("Failed to find a supported physical device"); the Mesa 25 lavapipe in
# bookworm-backports has it. This script:
#   1. installs the Vulkan loader (libvulkan1) and the shared libraries lavapipe links against from
#      the normal bookworm repo when they are missing (needs root; --no-install-recommends),
#   2. downloads mesa-vulkan-drivers from bookworm-backports with `apt-get download`, using a
#      private apt configuration (sources, lists, cache under the target folder: the system's
#      sources.list is never changed),
#   3. unpacks it with `dpkg-deb -x` into the target folder and writes an ICD manifest whose
#      library_path is absolute (so the system's Mesa 22 lavapipe is never picked by mistake),
#   4. prints the environment to export (stdout); progress goes to stderr, so
#          eval "$(sim/setup_vulkan.sh)"
#      sets it in the calling shell.
#
# Idempotent: a second run only checks and prints. Options:
#   --dir DIR   target folder (default: $RLVLA3_VULKAN_DIR, else ${XDG_CACHE_HOME:-~/.cache}/rlvla3/vulkan)
#   --force     download and unpack again
# Environment: DEBIAN_MIRROR (default http://deb.debian.org/debian).
set -euo pipefail

DIR="${RLVLA3_VULKAN_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/rlvla3/vulkan}"
FORCE=0
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm-backports
KEYRING=/usr/share/keyrings/debian-archive-keyring.gpg

while [[ $# -gt 0 ]]; do
    case "$1" in
        --dir) DIR="$2"; shift 2 ;;
        --force) FORCE=1; shift ;;
        -h|--help) sed -n '2,24p' "$0"; exit 0 ;;
        *) echo "unknown option: $1" >&2; exit 2 ;;
    esac
done

log() { echo "[setup_vulkan] $*" >&2; }
die() { echo "[setup_vulkan] error: $*" >&2; exit 1; }

ARCH_M="$(uname -m)"                         # x86_64, aarch64
TRIPLET="${ARCH_M}-linux-gnu"
LIB="$DIR/root/usr/lib/$TRIPLET/libvulkan_lvp.so"
ICD="$DIR/lvp_icd.${ARCH_M}.json"

as_root() {
    if [[ $EUID -eq 0 ]]; then "$@"
    elif command -v sudo >/dev/null; then sudo "$@"
    else die "need root for: $*"; fi
}

apt_install() {  # packages from the normal (system) repositories
    log "apt-get install --no-install-recommends $*"
    as_root apt-get install -y -qq --no-install-recommends "$@" >&2 \
        || { as_root apt-get update -qq >&2 && as_root apt-get install -y -qq --no-install-recommends "$@" >&2; }
}

ensure_loader() {
    local cache
    cache="$(ldconfig -p 2>/dev/null || true)"  # no pipe into grep -q: pipefail + SIGPIPE
    if ! grep -q 'libvulkan\.so\.1 ' <<<"$cache"; then
        apt_install libvulkan1
    fi
}

private_apt() {  # apt-get with sources, lists and cache under $DIR/apt
    local p="$DIR/apt"
    apt-get -o Dir::Etc::sourcelist="$p/sources.list" -o Dir::Etc::sourceparts="$p/sources.list.d" \
        -o Dir::Etc::preferencesparts="$p/preferences.d" -o Dir::State::lists="$p/lists" \
        -o Dir::Cache="$p/cache" -o Debug::NoLocking=1 -o APT::Sandbox::User="$(id -un)" "$@"
}

download_deb() {
    local p="$DIR/apt"
    mkdir -p "$p/sources.list.d" "$p/preferences.d" "$p/lists/partial" "$p/cache/archives/partial" \
        "$DIR/debs"
    [[ -r $KEYRING ]] || die "missing $KEYRING (apt-get install debian-archive-keyring)"
    echo "deb [signed-by=$KEYRING] $MIRROR $SUITE main" >"$p/sources.list"
    log "apt-get update ($SUITE, private lists in $p)"
    private_apt update -qq >&2
    rm -f "$DIR"/debs/mesa-vulkan-drivers_*.deb
    log "apt-get download mesa-vulkan-drivers/$SUITE"
    (cd "$DIR/debs" && private_apt download -qq "mesa-vulkan-drivers/$SUITE" >&2)
}

install_link_deps() {  # the .deb's Depends, names only, from the normal repo (versions ignored)
    local deb deps
    deb="$(ls "$DIR"/debs/mesa-vulkan-drivers_*.deb)"
    deps="$(dpkg-deb -f "$deb" Depends | tr ',' '\n' | sed -E 's/\|.*//; s/\(.*\)//; s/:any//' \
        | tr -d ' ' | grep -v '^$' | grep -v '^python3')"
    local d st missing=()
    for d in $deps; do
        st="$(dpkg-query -W -f='${db:Status-Abbrev}' "$d" 2>/dev/null || true)"
        [[ $st == ii* ]] || missing+=("$d")
    done
    if [[ ${#missing[@]} -gt 0 ]]; then apt_install "${missing[@]}"; fi
}

unpack() {
    local deb
    deb="$(ls "$DIR"/debs/mesa-vulkan-drivers_*.deb)"
    rm -rf "$DIR/root"
    log "dpkg-deb -x $(basename "$deb") $DIR/root"
    dpkg-deb -x "$deb" "$DIR/root"
    [[ -f $LIB ]] || die "lavapipe not found in the package: $LIB"
    local api
    api="$(sed -nE 's/.*"api_version": *"([^"]+)".*/\1/p' "$DIR/root/usr/share/vulkan/icd.d/lvp_icd.json")"
    printf '{\n  "file_format_version": "1.0.0",\n  "ICD": {"library_path": "%s", "api_version": "%s"}\n}\n' \
        "$LIB" "${api:-1.3.0}" >"$ICD"
}

check_links() {
    local out
    out="$(ldd -r "$LIB" 2>&1 || true)"
    if grep -qE 'not found|undefined symbol' <<<"$out"; then
        grep -E 'not found|undefined symbol' <<<"$out" >&2
        die "lavapipe has unresolved libraries/symbols (see above)"
    fi
}

ensure_loader
if [[ $FORCE -eq 1 || ! -f $LIB || ! -f $ICD ]]; then
    download_deb
    install_link_deps
    unpack
else
    log "already installed in $DIR (--force to redo)"
fi
check_links
log "ok: $(ls "$DIR"/debs/mesa-vulkan-drivers_*.deb | xargs -n1 basename)"
echo "export VK_ICD_FILENAMES=$ICD"
echo "export VK_DRIVER_FILES=$ICD"
