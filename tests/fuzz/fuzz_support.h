#pragma once
// What both fuzz targets share: the oracle "only retrace's own errors may escape" and invariant
// checks that end the run with a message (libFuzzer then saves the input as a crash).

#include <retrace/error.h>

#include <exception>
#include <string>

namespace retrace::fuzz {

// Prints "fuzz: invariant broken: WHAT" and aborts: libFuzzer saves the input as a crash.
[[noreturn]] void fail(const std::string& what);

inline void check(bool ok, const char* what) {
  if (!ok) fail(what);
}

// The demangled type of the exception being handled.
std::string current_exception_type();

// Runs `fn`. A retrace::Error is the expected refusal of a bad input; any other exception fails
// the run, naming its type and message.
template <typename F>
void only_retrace_errors(F&& fn) {
  try {
    fn();
  } catch (const retrace::Error&) {
  } catch (const std::exception& e) {
    fail("an exception that is not a retrace::Error escaped: " + current_exception_type() + ": " + e.what());
  } catch (...) {
    fail("an exception that is not a retrace::Error escaped: " + current_exception_type());
  }
}

}  // namespace retrace::fuzz
