/* The README's C example, whole: decode WRITEs into prefill's registered memory with a
 * notification, and prefill checks the bytes after the notification arrived.
 * tools/check-front-door.sh checks that every line of the README's example is here, in
 * order, and builds this file against an installed copy (ffi/install.sh). */
#define _POSIX_C_SOURCE 199309L
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"

#define LEN (1u << 20)

int main(void) {
    kvrail_agent *p, *d;  uint32_t kv, src;  char addr[64], peer[64];  size_t n;  kvrail_xfer *x;
    CHECK(kvrail_agent_new("prefill-0", "{\"listen\":\"127.0.0.1:0\"}", &p));
    CHECK(kvrail_agent_new("decode-0", "{\"listen\":\"127.0.0.1:0\"}", &d));
    CHECK(kvrail_agent_register(p, LEN, KVRAIL_ACCESS_WRITE, &kv));
    CHECK(kvrail_agent_register(d, LEN, KVRAIL_ACCESS_NONE, &src));
    uint8_t *bytes = malloc(LEN);
    for (size_t i = 0; i < LEN; i++) bytes[i] = (uint8_t)(i * 7 % 251);
    CHECK(kvrail_agent_write_region(d, src, 0, bytes, LEN));
    CHECK(kvrail_agent_side_channel_addr(p, (uint8_t *)addr, sizeof addr - 1, &n)); addr[n] = 0;
    CHECK(kvrail_agent_load_remote(d, addr, (uint8_t *)peer, sizeof peer - 1, &n)); peer[n] = 0;
    kvrail_desc l = {src, 0, LEN}, r = {kv, 0, LEN};
    CHECK(kvrail_xfer_new(d, KVRAIL_OP_WRITE, &l, 1, peer, &r, 1, (const uint8_t *)"done", 4, &x));
    CHECK(kvrail_xfer_post(x));
    CHECK(kvrail_xfer_wait(x, 10000));  /* then P's notification "done" follows the bytes */
    CHECK(kvrail_xfer_free(x));

    char from[64], note[64];
    size_t from_len = 0, len = 0;
    bool got = false;
    for (int tries = 0; !got && tries < 10000; tries++) {
        CHECK(kvrail_agent_get_notif(p, (uint8_t *)from, sizeof from, &from_len, (uint8_t *)note, sizeof note, &len, &got));
        if (!got) nanosleep(&(struct timespec){0, 1000000}, NULL);
    }
    if (!got || len != 4 || memcmp(note, "done", 4)) { fprintf(stderr, "no notification \"done\"\n"); return 1; }
    uint8_t *landed = malloc(LEN);
    CHECK(kvrail_agent_read_region(p, kv, 0, landed, LEN));
    if (memcmp(landed, bytes, LEN)) { fprintf(stderr, "the bytes differ\n"); return 1; }
    printf("README example: %u bytes written, the notification after them\n", LEN);
    kvrail_agent_free(d);
    kvrail_agent_free(p);
    free(bytes);
    free(landed);
    return 0;
}
