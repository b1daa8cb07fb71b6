/* Shared by the C examples: print a failed call with kvrail's message and return 1. */
#ifndef KVRAIL_EXAMPLE_CHECK_H
#define KVRAIL_EXAMPLE_CHECK_H
#include <stdio.h>

#include "kvrail.h"

static int fail(const char *what, kvrail_result r) {
    char msg[512];
    size_t n = 0;
    kvrail_last_error((uint8_t *)msg, sizeof msg - 1, &n);
    msg[n] = 0;
    fprintf(stderr, "%s: %s (%u): %s\n", what, kvrail_result_message(r), (unsigned)r, msg);
    return 1;
}

#define CHECK(call)                                          \
    do {                                                     \
        kvrail_result r_ = (call);                           \
        if (r_ != KVRAIL_RESULT_OK) return fail(#call, r_);  \
    } while (0)

#endif
