// Anchors the shared precompiled header (cmake/RetraceTargets.cmake).
