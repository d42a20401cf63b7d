#!/usr/bin/env bash
# check-install.sh DIR — checks that DIR is a self-contained relocatable gpurpc install
# (cmake --install BUILD --prefix DIR): every ELF file under DIR/libexec/gpurpc and
# DIR/lib/gpurpc resolves all of its shared libraries, and every library it loads comes either
# from DIR/lib/gpurpc or from the small set that any target machine provides (glibc, the C++
# runtime). It also runs the launcher with --help. Exit status 0 when all is well.
set -euo pipefail

dir=${1:?usage: check-install.sh INSTALL_DIR}
dir=$(cd -- "$dir" && pwd -P)
libdir="$dir/lib/gpurpc"
# Libraries the target provides itself (same list as cmake/GpurpcInstall.cmake excludes).
system_libs='ld-linux[^/]*|libc|libm|libmvec|libpthread|libdl|librt|libresolv|libutil|libanl'
system_libs+='|libnsl|libBrokenLocale|libthread_db|libstdc\+\+|libgcc_s'
system_re="/($system_libs)\\.so[^/]*\$"

fail() { echo "check-install: $*" >&2; exit 1; }
[[ -x "$dir/libexec/gpurpc/gpurpcd" ]] || fail "no $dir/libexec/gpurpc/gpurpcd"
[[ -x "$dir/bin/gpurpcd" ]] || fail "no launcher $dir/bin/gpurpcd"
[[ -d "$libdir" ]] || fail "no $libdir"

problems=0
files=0
while IFS= read -r -d '' file; do
  head -c 4 "$file" | grep -q 'ELF' || continue
  files=$((files + 1))
  while IFS= read -r line; do
    # "libfoo.so.1 => /path/libfoo.so.1 (0x...)", "libbar.so => not found", "/lib64/ld-linux..."
    if [[ "$line" == *"not found"* ]]; then
      echo "check-install: ${file#"$dir"/}: ${line%% *} not found" >&2
      problems=$((problems + 1))
      continue
    fi
    [[ "$line" == *"=> /"* ]] || continue
    path=${line#*=> }
    path=${path%% (*}
    [[ "$path" == "$libdir/"* ]] && continue
    [[ "$path" =~ $system_re ]] && continue
    echo "check-install: ${file#"$dir"/}: ${line%% *} comes from $path, not from lib/gpurpc" >&2
    problems=$((problems + 1))
  done < <(LD_LIBRARY_PATH="$libdir" ldd "$file" 2>&1 | sed 's/^[[:space:]]*//')
done < <(find "$dir/libexec/gpurpc" "$libdir" -type f -print0)

# No symlinks: the folder must survive copies that do not keep them.
links=$(find "$dir" -type l)
if [[ -n "$links" ]]; then
  echo "check-install: symlinks in the install:" >&2
  echo "$links" >&2
  problems=$((problems + 1))
fi

if ! help=$("$dir/bin/gpurpcd" --help 2>&1); then
  echo "check-install: '$dir/bin/gpurpcd --help' failed:" >&2
  echo "$help" >&2
  problems=$((problems + 1))
fi

libs=$(find "$libdir" -type f | wc -l)
size=$(du -sh "$dir" | cut -f1)
if ((problems)); then
  echo "check-install: $problems problems in $dir ($files ELF files, $libs bundled libraries)" >&2
  exit 1
fi
echo "check-install: ok: $dir ($files ELF files, $libs bundled libraries, $size)"
