# Relocatable install.
#
#   cmake --install build --prefix DIR [--strip]
#
# produces a folder that runs on a machine with none of gRPC, protobuf, Abseil or spdlog
# installed (e.g. an Ubuntu 24.04 GPU box), wherever it is copied:
#
#   DIR/bin/gpurpcd                    launcher: sets LD_LIBRARY_PATH, execs the real daemon
#   DIR/bin/gpurpc-run-tests           runs every installed test binary, prints a summary
#   DIR/bin/gpurpc_bench_*             launchers for the benchmarks (when they are built)
#   DIR/bin/gpurpc-soak                launcher for the soak and leak check (tests/soak)
#   DIR/libexec/gpurpc/gpurpcd         the real daemon (workers re-execute it via /proc/self/exe)
#   DIR/libexec/gpurpc/bench/          benchmark binaries
#   DIR/libexec/gpurpc/gpurpc-soak     the soak program (re-executes itself for its killed clients)
#   DIR/libexec/gpurpc/tests/          every executable under tests/ whose name ends in _test
#   DIR/lib/gpurpc/                    every non-system shared library those binaries need
#   DIR/share/doc/gpurpc/              README.md, DESIGN.md (docs/) and the systemd unit
#
# Left out of lib/gpurpc on purpose: glibc's libraries (the target has a newer glibc),
# libstdc++/libgcc_s (newer on every supported target; binaries built against an older one run
# against a newer one), and libcuda/libnvrtc, which the daemon dlopen()s at run time and which
# must match the machine's driver and toolkit.
#
# The launchers exist because RUNPATH is not transitive: our binaries carry
# $ORIGIN-relative RUNPATHs, but Debian's gRPC libraries find each other (and protobuf, Abseil,
# re2, ...) only through the system paths, so on the target they need LD_LIBRARY_PATH.
include_guard(GLOBAL)

# Fixed, prefix-relative layout: the launchers compute every path from their own location.
set(GPURPC_INSTALL_BINDIR "bin")
set(GPURPC_INSTALL_LIBEXECDIR "libexec/gpurpc")
set(GPURPC_INSTALL_TESTDIR "libexec/gpurpc/tests")
set(GPURPC_INSTALL_BENCHDIR "libexec/gpurpc/bench")
set(GPURPC_INSTALL_PRIVATE_LIBDIR "lib/gpurpc")
set(GPURPC_INSTALL_DOCDIR "share/doc/gpurpc")

# gpurpc_collect_executables(<out-var> <dir>): every executable target defined in <dir> and,
# recursively, in its subdirectories. Imported targets are not build-system targets, so
# dependencies such as gRPC's plugins never show up here.
function(gpurpc_collect_executables out dir)
  set(found "")
  get_property(targets DIRECTORY "${dir}" PROPERTY BUILDSYSTEM_TARGETS)
  foreach(target IN LISTS targets)
    get_target_property(type ${target} TYPE)
    if(type STREQUAL "EXECUTABLE")
      list(APPEND found ${target})
    endif()
  endforeach()
  get_property(subdirs DIRECTORY "${dir}" PROPERTY SUBDIRECTORIES)
  foreach(subdir IN LISTS subdirs)
    gpurpc_collect_executables(sub "${subdir}")
    list(APPEND found ${sub})
  endforeach()
  set(${out} "${found}" PARENT_SCOPE)
endfunction()

# gpurpc_install_launcher(<name> <relative-target>): DIR/bin/<name>, a shell script that runs
# DIR/<relative-target> with LD_LIBRARY_PATH (and GPURPCD_BIN, for clients) set.
function(gpurpc_install_launcher name relative_target)
  set(GPURPC_LAUNCH_NAME "${name}")
  set(GPURPC_LAUNCH_TARGET "${relative_target}")
  set(GPURPC_LAUNCH_LIBDIR "${GPURPC_INSTALL_PRIVATE_LIBDIR}")
  set(GPURPC_LAUNCH_DAEMON "${GPURPC_INSTALL_LIBEXECDIR}/gpurpcd")
  set(script "${PROJECT_BINARY_DIR}/gpurpc-launchers/${name}")
  configure_file("${PROJECT_SOURCE_DIR}/deploy/bin/launcher.sh.in" "${script}" @ONLY)
  install(PROGRAMS "${script}" DESTINATION "${GPURPC_INSTALL_BINDIR}" COMPONENT gpurpc)
endfunction()

set(_gpurpc_installed_executables "")

# Each installed binary gets a RUNPATH relative to its own location (the project-wide
# CMAKE_INSTALL_RPATH assumes bin/ next to lib/, which is not this layout). The launchers still
# set LD_LIBRARY_PATH; the RUNPATH only lets `ldd` and direct runs find the direct dependencies.

# The daemon.
if(TARGET gpurpcd)
  set_target_properties(gpurpcd PROPERTIES
    INSTALL_RPATH "$ORIGIN/../../${GPURPC_INSTALL_PRIVATE_LIBDIR}")
  install(TARGETS gpurpcd RUNTIME DESTINATION "${GPURPC_INSTALL_LIBEXECDIR}" COMPONENT gpurpc)
  gpurpc_install_launcher(gpurpcd "${GPURPC_INSTALL_LIBEXECDIR}/gpurpcd")
  list(APPEND _gpurpc_installed_executables gpurpcd)
endif()

# The soak and leak check (tests/soak, built with the tests). Its launcher sets GPURPCD_BIN to
# this install's daemon, which it starts by default.
if(TARGET gpurpc_soak)
  set_target_properties(gpurpc_soak PROPERTIES
    INSTALL_RPATH "$ORIGIN/../../${GPURPC_INSTALL_PRIVATE_LIBDIR}")
  install(TARGETS gpurpc_soak RUNTIME DESTINATION "${GPURPC_INSTALL_LIBEXECDIR}" COMPONENT gpurpc
          OPTIONAL)
  gpurpc_install_launcher(gpurpc-soak "${GPURPC_INSTALL_LIBEXECDIR}/gpurpc-soak")
  list(APPEND _gpurpc_installed_executables gpurpc_soak)
endif()

# Benchmarks: any executable named gpurpc_bench_* anywhere in the project (today
# gpurpc_bench_memory and gpurpc_bench_compute, when they are built).
gpurpc_collect_executables(_gpurpc_all_executables "${PROJECT_SOURCE_DIR}")
foreach(target IN LISTS _gpurpc_all_executables)
  if(target MATCHES "^gpurpc_bench_")
    set_target_properties(${target} PROPERTIES
      INSTALL_RPATH "$ORIGIN/../../../${GPURPC_INSTALL_PRIVATE_LIBDIR}")
    install(TARGETS ${target} RUNTIME DESTINATION "${GPURPC_INSTALL_BENCHDIR}" COMPONENT gpurpc
            OPTIONAL)
    get_target_property(_gpurpc_output_name ${target} OUTPUT_NAME)
    if(NOT _gpurpc_output_name)
      set(_gpurpc_output_name ${target})
    endif()
    gpurpc_install_launcher(${_gpurpc_output_name}
                            "${GPURPC_INSTALL_BENCHDIR}/${_gpurpc_output_name}")
    list(APPEND _gpurpc_installed_executables ${target})
  endif()
endforeach()

# Tests: every executable under tests/ whose name ends in _test, for gpurpc-run-tests on a GPU
# box. (Only when the tests were configured; GPURPC_BUILD_TESTS=OFF leaves them out.)
set(_gpurpc_test_targets "")
if(EXISTS "${PROJECT_SOURCE_DIR}/tests/CMakeLists.txt" AND GPURPC_BUILD_TESTS)
  gpurpc_collect_executables(_gpurpc_tests_executables "${PROJECT_SOURCE_DIR}/tests")
  foreach(target IN LISTS _gpurpc_tests_executables)
    if(target MATCHES "_test$")
      list(APPEND _gpurpc_test_targets ${target})
    endif()
  endforeach()
endif()
if(_gpurpc_test_targets)
  set_target_properties(${_gpurpc_test_targets} PROPERTIES
    INSTALL_RPATH "$ORIGIN/../../../${GPURPC_INSTALL_PRIVATE_LIBDIR}")
  # OPTIONAL: a test that did not build (`cmake --build -k`) is left out, not fatal; the install
  # says which. The daemon itself is never optional.
  install(TARGETS ${_gpurpc_test_targets} RUNTIME DESTINATION "${GPURPC_INSTALL_TESTDIR}"
          COMPONENT gpurpc OPTIONAL)
  list(APPEND _gpurpc_installed_executables ${_gpurpc_test_targets})
endif()
install(PROGRAMS "${PROJECT_SOURCE_DIR}/deploy/bin/gpurpc-run-tests"
        DESTINATION "${GPURPC_INSTALL_BINDIR}" COMPONENT gpurpc)

# Documentation and the service unit, so that the folder is self-describing.
foreach(doc README.md docs/DESIGN.md deploy/systemd/gpurpcd.service
            deploy/systemd/gpurpc.sysusers.conf deploy/systemd/gpurpcd.default)
  if(EXISTS "${PROJECT_SOURCE_DIR}/${doc}")
    install(FILES "${PROJECT_SOURCE_DIR}/${doc}" DESTINATION "${GPURPC_INSTALL_DOCDIR}"
            COMPONENT gpurpc)
  endif()
endforeach()

# The shared libraries. Resolved at install time from the built binaries (the build tree's
# copies: same DT_NEEDED entries as the installed ones). Each library is copied as a regular
# file under the name the loader asks for (its SONAME, as written in DT_NEEDED), so the folder
# has no symlinks to break when it is copied, archived or carried.
if(_gpurpc_installed_executables)
  set(_gpurpc_executable_files "")
  foreach(target IN LISTS _gpurpc_installed_executables)
    list(APPEND _gpurpc_executable_files "$<TARGET_FILE:${target}>")
  endforeach()
  install(CODE "set(_gpurpc_executable_files \"${_gpurpc_executable_files}\")
set(_gpurpc_libdir \"${GPURPC_INSTALL_PRIVATE_LIBDIR}\")"
          COMPONENT gpurpc)
  install(CODE [[
    # Excluded by the name the loader asks for (DT_NEEDED), at every depth: the loader and the
    # vDSO; glibc's own libraries (libcrypt is libxcrypt now, not glibc, so it is bundled when
    # needed); the C++ runtime (libstdc++, libgcc_s); the driver and NVRTC (dlopen'ed, and they
    # must match the machine).
    set(_gpurpc_exclude_names
      "^ld-linux.*\\.so" "^linux-vdso\\.so" "^linux-gate\\.so"
      "^libc\\.so" "^libm\\.so" "^libmvec\\.so" "^libpthread\\.so" "^libdl\\.so" "^librt\\.so"
      "^libresolv\\.so" "^libutil\\.so" "^libanl\\.so" "^libnsl\\.so" "^libBrokenLocale\\.so"
      "^libthread_db\\.so"
      "^libstdc\\+\\+\\.so" "^libgcc_s\\.so"
      "^libcuda\\.so" "^libnvidia-" "^libnvrtc")
    set(_gpurpc_built "")
    foreach(_gpurpc_file IN LISTS _gpurpc_executable_files)
      if(EXISTS "${_gpurpc_file}")
        list(APPEND _gpurpc_built "${_gpurpc_file}")
      else()
        message(STATUS "gpurpc: not built, left out: ${_gpurpc_file}")
      endif()
    endforeach()
    file(GET_RUNTIME_DEPENDENCIES
      EXECUTABLES ${_gpurpc_built}
      RESOLVED_DEPENDENCIES_VAR _gpurpc_resolved
      UNRESOLVED_DEPENDENCIES_VAR _gpurpc_unresolved
      CONFLICTING_DEPENDENCIES_PREFIX _gpurpc_conflict
      PRE_EXCLUDE_REGEXES ${_gpurpc_exclude_names})
    if(_gpurpc_unresolved)
      message(FATAL_ERROR "gpurpc: unresolved shared libraries: ${_gpurpc_unresolved}")
    endif()
    foreach(_gpurpc_name IN LISTS _gpurpc_conflict_FILENAMES)
      list(GET _gpurpc_conflict_${_gpurpc_name} 0 _gpurpc_first)
      message(WARNING "gpurpc: ${_gpurpc_name} found in several places "
                      "(${_gpurpc_conflict_${_gpurpc_name}}); bundling ${_gpurpc_first}")
      list(APPEND _gpurpc_resolved "${_gpurpc_first}")
    endforeach()
    list(REMOVE_DUPLICATES _gpurpc_resolved)
    list(SORT _gpurpc_resolved)
    foreach(_gpurpc_lib IN LISTS _gpurpc_resolved)
      get_filename_component(_gpurpc_soname "${_gpurpc_lib}" NAME)
      file(REAL_PATH "${_gpurpc_lib}" _gpurpc_real)
      file(INSTALL DESTINATION "${CMAKE_INSTALL_PREFIX}/${_gpurpc_libdir}"
           TYPE FILE
           PERMISSIONS OWNER_READ OWNER_WRITE GROUP_READ WORLD_READ
           RENAME "${_gpurpc_soname}"
           FILES "${_gpurpc_real}")
    endforeach()
    list(LENGTH _gpurpc_resolved _gpurpc_count)
    message(STATUS "gpurpc: bundled ${_gpurpc_count} shared libraries into "
                   "$ENV{DESTDIR}${CMAKE_INSTALL_PREFIX}/${_gpurpc_libdir}")
  ]] COMPONENT gpurpc)
endif()
