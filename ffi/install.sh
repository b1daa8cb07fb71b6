#!/bin/bash
# ffi/install.sh PREFIX [LIBDIR_IN] — install kvrail's C library the way a distribution
# would: PREFIX/lib/libkvrail_ffi.so.X.Y.Z with its soname link (libkvrail_ffi.so.0.Y before
# 1.0) and the development link (libkvrail_ffi.so), libkvrail_ffi.a, PREFIX/include/kvrail.h,
# and a generated PREFIX/lib/pkgconfig/kvrail.pc, so that
#   cc prog.c $(PKG_CONFIG_PATH=PREFIX/lib/pkgconfig pkg-config --cflags --libs kvrail)
# builds a program against it, and PREFIX/lib/cmake/kvrail/ (kvrailConfig.cmake with its
# version file), so that CMake's `find_package(kvrail 0.1 REQUIRED)` gives the imported
# target `kvrail::kvrail`. LIBDIR_IN is where cargo put the library (default: builds
# target/release with `cargo build --release -p kvrail-ffi`).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PREFIX=${1:?usage: ffi/install.sh PREFIX [LIBDIR_IN]}
IN=${2:-}
if [ -z "$IN" ]; then
    cargo build --release -q -p kvrail-ffi --lib
    IN=target/release
fi
VERSION=$(sed -n 's/^version = "\(.*\)"/\1/p' ffi/Cargo.toml | head -1)
MAJOR=${VERSION%%.*}
REST=${VERSION#*.}
MINOR=${REST%%.*}
if [ "$MAJOR" = 0 ]; then ABI="0.$MINOR"; else ABI=$MAJOR; fi
SONAME=$(readelf -d "$IN/libkvrail_ffi.so" | sed -n 's/.*Library soname: \[\(.*\)\]/\1/p')
[ "$SONAME" = "libkvrail_ffi.so.$ABI" ] \
    || { echo "install.sh: $IN/libkvrail_ffi.so has soname '$SONAME', expected libkvrail_ffi.so.$ABI" >&2; exit 1; }
mkdir -p "$PREFIX/lib/pkgconfig" "$PREFIX/include"
install -m 0755 "$IN/libkvrail_ffi.so" "$PREFIX/lib/libkvrail_ffi.so.$VERSION"
ln -sf "libkvrail_ffi.so.$VERSION" "$PREFIX/lib/$SONAME"
ln -sf "$SONAME" "$PREFIX/lib/libkvrail_ffi.so"
[ -f "$IN/libkvrail_ffi.a" ] && install -m 0644 "$IN/libkvrail_ffi.a" "$PREFIX/lib/"
install -m 0644 ffi/include/kvrail.h "$PREFIX/include/kvrail.h"
cat > "$PREFIX/lib/pkgconfig/kvrail.pc" <<PC
prefix=$PREFIX
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: kvrail
Description: KV-cache block transfer over raw ibverbs RC queue pairs (C ABI)
Version: $VERSION
Libs: -L\${libdir} -lkvrail_ffi
Libs.private: -ldl -lpthread -lm
Cflags: -I\${includedir}
PC
mkdir -p "$PREFIX/lib/cmake/kvrail"
cat > "$PREFIX/lib/cmake/kvrail/kvrailConfig.cmake" <<'CM'
# kvrail's C library: the imported target kvrail::kvrail (header and shared library).
get_filename_component(_kvrail_prefix "${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
if(NOT TARGET kvrail::kvrail)
  add_library(kvrail::kvrail SHARED IMPORTED)
  set_target_properties(kvrail::kvrail PROPERTIES
    IMPORTED_LOCATION "${_kvrail_prefix}/lib/libkvrail_ffi.so.@VERSION@"
    IMPORTED_SONAME "@SONAME@"
    INTERFACE_INCLUDE_DIRECTORIES "${_kvrail_prefix}/include")
endif()
set(kvrail_INCLUDE_DIRS "${_kvrail_prefix}/include")
set(kvrail_LIBRARIES kvrail::kvrail)
unset(_kvrail_prefix)
CM
sed -i "s/@VERSION@/$VERSION/; s/@SONAME@/$SONAME/" "$PREFIX/lib/cmake/kvrail/kvrailConfig.cmake"
cat > "$PREFIX/lib/cmake/kvrail/kvrailConfigVersion.cmake" <<'CM'
# Compatible: the same ABI (0.MINOR before 1.0, MAJOR after), at least the version asked for.
set(PACKAGE_VERSION "@VERSION@")
if(PACKAGE_FIND_VERSION VERSION_GREATER PACKAGE_VERSION)
  set(PACKAGE_VERSION_COMPATIBLE FALSE)
elseif("@MAJOR@" STREQUAL "0" AND NOT "${PACKAGE_FIND_VERSION_MAJOR}.${PACKAGE_FIND_VERSION_MINOR}" STREQUAL "@ABI@")
  set(PACKAGE_VERSION_COMPATIBLE FALSE)
elseif(NOT "@MAJOR@" STREQUAL "0" AND NOT "${PACKAGE_FIND_VERSION_MAJOR}" STREQUAL "@MAJOR@")
  set(PACKAGE_VERSION_COMPATIBLE FALSE)
else()
  set(PACKAGE_VERSION_COMPATIBLE TRUE)
  if(PACKAGE_FIND_VERSION VERSION_EQUAL PACKAGE_VERSION)
    set(PACKAGE_VERSION_EXACT TRUE)
  endif()
endif()
CM
sed -i "s/@VERSION@/$VERSION/; s/@MAJOR@/$MAJOR/g; s/@ABI@/$ABI/" "$PREFIX/lib/cmake/kvrail/kvrailConfigVersion.cmake"
echo "installed kvrail $VERSION (soname $SONAME) under $PREFIX"
