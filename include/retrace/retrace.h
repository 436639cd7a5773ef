#pragma once
// Umbrella header: everything public in retrace.
#include <retrace/autocast.h>
#include <retrace/checkpoint.h>
#include <retrace/determinism.h>
#include <retrace/diff.h>
#include <retrace/digest.h>
#include <retrace/error.h>
#include <retrace/memory.h>
#include <retrace/observer.h>
#include <retrace/rng.h>
#include <retrace/sequential.h>
#include <retrace/verify.h>
#include <retrace/version.h>
