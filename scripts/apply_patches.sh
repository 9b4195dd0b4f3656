#!/usr/bin/env bash
# Apply megatron-metp's patches to a Megatron-LM checkout at a supported release tag; the series
# is chosen by the checkout's commit (patches/<tag>/*.patch).
#
#   scripts/apply_patches.sh [--check | --revert] MEGATRON_LM_DIR
#
#   (no option)  apply every patch that is not applied yet; patches already applied are left
#                alone, so running it twice is safe
#   --check      only report, for each patch, whether it is applied, applicable or conflicting;
#                exit 0 when every patch is applied or applicable
#   --revert     take applied patches out again (newest first)
#
# Supported releases (the checkout's HEAD must be one of these commits):
#   core_v0.16.1  55ac7082517c3878ae653c07c09c534b8aed49f6  patches/core_v0.16.1/
#   core_v0.19.0  5be9626709af2722333bf54797c954c09edeada3  patches/core_v0.19.0/
# Set METP_ALLOW_OTHER_COMMIT=1 to try another commit anyway, with the series named by
# METP_PATCH_SERIES (default core_v0.19.0); every patch is still checked with
# `git apply --check` before anything is written.
set -euo pipefail

# tag -> commit of every supported release (one patch series each under patches/<tag>/)
declare -A RELEASE_COMMITS=(
    [core_v0.16.1]=55ac7082517c3878ae653c07c09c534b8aed49f6
    [core_v0.19.0]=5be9626709af2722333bf54797c954c09edeada3
)
NEWEST_TAG=core_v0.19.0
PATCH_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../patches" && pwd)"

usage() {
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "${BASH_SOURCE[0]}"
}

die() {
    echo "apply_patches.sh: error: $*" >&2
    exit 1
}

mode=apply
case "${1:-}" in
    --check) mode=check; shift ;;
    --revert) mode=revert; shift ;;
    -h|--help) usage; exit 0 ;;
esac
[[ $# -eq 1 ]] || { usage >&2; exit 2; }
dir=$1

[[ -d "$dir" ]] || die "'$dir' is not a directory. Clone Megatron-LM first:
    git clone --branch $NEWEST_TAG https://github.com/NVIDIA/Megatron-LM.git $dir"
command -v git >/dev/null || die "git is not installed"
top=$(git -C "$dir" rev-parse --show-toplevel 2>/dev/null) ||
    die "'$dir' is not a git checkout (a source archive cannot be checked against the tag). Use
    git clone --branch $NEWEST_TAG https://github.com/NVIDIA/Megatron-LM.git <dir>"
dir=$top
[[ -f "$dir/pretrain_gpt.py" && -f "$dir/megatron/training/arguments.py" ]] ||
    die "'$dir' does not look like Megatron-LM (no pretrain_gpt.py or megatron/training/arguments.py)"

head=$(git -C "$dir" rev-parse HEAD)
tag=
for t in "${!RELEASE_COMMITS[@]}"; do
    if [[ "${RELEASE_COMMITS[$t]}" == "$head" ]]; then tag=$t; fi
done
if [[ -z "$tag" ]]; then
    described=$(git -C "$dir" describe --tags --always HEAD 2>/dev/null || echo "$head")
    supported=$(for t in "${!RELEASE_COMMITS[@]}"; do
        echo "        $t = ${RELEASE_COMMITS[$t]}"
    done | sort)
    msg="'$dir' is at $head ($described), but the patches are made for
$supported
    Check out a supported tag:  git -C $dir fetch --tags origin && git -C $dir checkout $NEWEST_TAG"
    if [[ "${METP_ALLOW_OTHER_COMMIT:-0}" == 1 ]]; then
        tag=${METP_PATCH_SERIES:-$NEWEST_TAG}
        [[ -n "${RELEASE_COMMITS[$tag]:-}" ]] ||
            die "METP_PATCH_SERIES=$tag is not a patch series (one of: $(echo "${!RELEASE_COMMITS[@]}" | tr ' ' '\n' | sort | tr '\n' ' '))"
        echo "apply_patches.sh: warning: $msg" >&2
        echo "apply_patches.sh: warning: METP_ALLOW_OTHER_COMMIT=1: trying the $tag series anyway" >&2
    else
        die "$msg
    (or set METP_ALLOW_OTHER_COMMIT=1 to try this commit anyway, METP_PATCH_SERIES=<tag> naming the series)"
    fi
fi
PATCH_DIR=$PATCH_ROOT/$tag

shopt -s nullglob
patches=("$PATCH_DIR"/*.patch)
shopt -u nullglob
[[ ${#patches[@]} -gt 0 ]] || die "no patches found in $PATCH_DIR"

# state PATCH -> applied | applicable | conflict
state() {
    if git -C "$dir" apply --reverse --check "$1" >/dev/null 2>&1; then
        echo applied
    elif git -C "$dir" apply --check "$1" >/dev/null 2>&1; then
        echo applicable
    else
        echo conflict
    fi
}

explain_conflict() {
    local patch=$1 files
    echo "apply_patches.sh: error: $(basename "$patch") neither applies nor is applied in $dir." >&2
    echo "  git apply --check says:" >&2
    git -C "$dir" apply --check "$patch" 2>&1 | sed 's/^/    /' >&2 || true
    mapfile -t files < <(git -C "$dir" apply --numstat "$patch" | cut -f3)
    echo "  local changes to the files it touches (git status):" >&2
    git -C "$dir" status --short -- "${files[@]}" | sed 's/^/    /' >&2
    echo "  Put them back to the tag with:  git -C $dir checkout -- ${files[*]}" >&2
    echo "  then run this script again." >&2
}

failed=0
if [[ "$mode" == revert ]]; then
    for ((i = ${#patches[@]} - 1; i >= 0; i--)); do
        patch=${patches[$i]}
        case "$(state "$patch")" in
            applied)
                git -C "$dir" apply --reverse "$patch"
                echo "reverted      $(basename "$patch")" ;;
            applicable) echo "not applied   $(basename "$patch")" ;;
            *) explain_conflict "$patch"; failed=1 ;;
        esac
    done
    exit "$failed"
fi

# Check every patch before writing anything (the patches are independent of each other).
states=()
for patch in "${patches[@]}"; do
    s=$(state "$patch")
    states+=("$s")
    if [[ "$s" == conflict ]]; then
        explain_conflict "$patch"
        failed=1
    fi
done
if [[ "$failed" == 1 ]]; then
    [[ "$mode" == apply ]] && echo "apply_patches.sh: nothing was changed." >&2
    exit 1
fi
for i in "${!patches[@]}"; do
    patch=${patches[$i]}
    name=$(basename "$patch")
    if [[ "${states[$i]}" == applied ]]; then
        echo "already applied  $name"
    elif [[ "$mode" == check ]]; then
        echo "applicable       $name"
    else
        git -C "$dir" apply "$patch"
        echo "applied          $name"
    fi
done
if [[ "$failed" == 0 && "$mode" == apply ]]; then
    echo "Megatron-LM at $dir ($tag) is patched for METP. It imports megatron_metp: install this package"
    echo "(pip install -e <megatron-metp>) in the environment that runs pretrain_gpt.py."
fi
exit "$failed"
