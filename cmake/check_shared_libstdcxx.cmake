# Run after linking the extension (cmake -DLIB=... -DNM=... -DCXX=... -P this):
# fails the build when the library holds its own copy of libstdc++.
#
# A compiler that links libstdc++ statically into shared libraries (a wrapper
# adding -static-libstdc++, as one GPU image's /opt/gcc/bin/g++ does) gives
# the extension a second libstdc++ beside the one torch uses. Measured with
# torch 2.11: every TORCH_CHECK whose message formats a number crashed
# (std::ostream::_M_insert<long> of the extension's copy reading the other
# copy's locale), and so did the engine. The sign: the library defines that
# function instead of importing it.
execute_process(COMMAND "${NM}" --defined-only "${LIB}" OUTPUT_VARIABLE syms ERROR_QUIET RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  execute_process(COMMAND "${NM}" -D --defined-only "${LIB}" OUTPUT_VARIABLE syms ERROR_QUIET)
endif()
if(syms MATCHES "_ZNSo9_M_insertIlEERSoT_")
  file(REMOVE "${LIB}")
  message(FATAL_ERROR
          "pycomm: the C++ compiler (${CXX}) linked libstdc++ statically into the extension, which then "
          "crashes beside torch's own libstdc++. Build with a compiler that links it as a shared library, "
          "e.g. CXX=/usr/bin/g++ CUDAHOSTCXX=/usr/bin/g++ pip install --no-build-isolation .")
endif()
