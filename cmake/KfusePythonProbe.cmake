# kfuse_python_guess(<cache var> <python code>): where <cache var> is empty, sets it to what <python code> prints in
# the Python that CMake finds (an empty print: not found). The code runs as the interpreter sees its packages, then
# in isolated mode (-I): under pip's build isolation (`pip install .`) the interpreter is the user's environment's,
# but PYTHONPATH points it at the build's own packages only; -I ignores that and finds what the README has the user
# install there first (the header-only CUTLASS and cuDNN-frontend wheels).
function(kfuse_python_guess var code)
  if(${var})
    return()
  endif()
  find_package(Python3 COMPONENTS Interpreter QUIET)
  if(NOT Python3_Interpreter_FOUND)
    return()
  endif()
  foreach(_kfuse_args "-c" "-I;-c")
    execute_process(COMMAND "${Python3_EXECUTABLE}" ${_kfuse_args} "${code}"
                    OUTPUT_VARIABLE _kfuse_guess OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    if(_kfuse_guess)
      set(${var} "${_kfuse_guess}" CACHE PATH "" FORCE)
      return()
    endif()
  endforeach()
endfunction()
