/* Two kvrail agents in one process, through the C ABI: decode READs three descriptors from
 * prefill's memory, then WRITEs a new pattern back, each with a notification; every byte is
 * checked. argv[1] / argv[2]: the agents' JSON configurations (host A = decode, host B =
 * prefill); default TCP on loopback. */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <time.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define LEN (1u << 20)


static uint8_t pattern(uint32_t seed, size_t i) { return (uint8_t)((i * 2654435761u) >> 13) ^ (uint8_t)seed ^ (uint8_t)i; }

/* Wait for one notification at `a`; 0 on success. */
static int wait_notif(const kvrail_agent *a, const char *want_from, const char *want) {
    for (int tries = 0; tries < 60000; tries++) {
        char from[64], data[64];
        size_t from_len = 0, len = 0;
        bool got = false;
        CHECK(kvrail_agent_get_notif(a, (uint8_t *)from, sizeof from, &from_len, (uint8_t *)data,
                                     sizeof data, &len, &got));
        if (got) {
            if (from_len != strlen(want_from) || memcmp(from, want_from, from_len) ||
                len != strlen(want) || memcmp(data, want, len)) {
                fprintf(stderr, "unexpected notification %.*s from %.*s\n", (int)len, data,
                        (int)from_len, from);
                return 1;
            }
            return 0;
        }
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    fprintf(stderr, "no notification \"%s\" from %s\n", want, want_from);
    return 1;
}

/* kvrail's DEBUG records: the registration and handshake lines must reach the callback */
static int seen_registered, seen_handshake;
static void on_log(uint32_t level, const char *target, const char *message, void *userdata) {
    (void)level; (void)target; (void)userdata;
    if (strstr(message, "memory registered")) seen_registered++;
    if (strstr(message, "handshake done; peer connected")) seen_handshake++;
}

int main(int argc, char **argv) {
    const char *cfg_a = argc > 1 ? argv[1] : "{\"backend\":\"tcp\",\"listen\":\"127.0.0.1:0\"}";
    const char *cfg_b = argc > 2 ? argv[2] : cfg_a;
    kvrail_set_log_callback(on_log, NULL);
    kvrail_set_log_level(KVRAIL_LOG_DEBUG);
    kvrail_agent *p = NULL, *d = NULL;
    CHECK(kvrail_agent_new("prefill-0", cfg_b, &p));
    CHECK(kvrail_agent_new("decode-0", cfg_a, &d));
    uint32_t backend = 99;
    CHECK(kvrail_agent_backend(d, &backend));
    printf("backend %s\n", backend == KVRAIL_BACKEND_VERBS ? "verbs" : "tcp");

    uint32_t src = 0, dst = 0;
    CHECK(kvrail_agent_register(p, LEN, KVRAIL_ACCESS_READ | KVRAIL_ACCESS_WRITE, &src));
    CHECK(kvrail_agent_register(d, LEN, KVRAIL_ACCESS_NONE, &dst));
    uint8_t *buf = malloc(LEN), *back = malloc(LEN);
    for (size_t i = 0; i < LEN; i++) buf[i] = pattern(1, i);
    CHECK(kvrail_agent_write_region(p, src, 0, buf, LEN));

    char addr[64], peer[64];
    size_t addr_len = 0, peer_len = 0;
    CHECK(kvrail_agent_side_channel_addr(p, (uint8_t *)addr, sizeof addr - 1, &addr_len));
    addr[addr_len] = 0;
    CHECK(kvrail_agent_load_remote(d, addr, (uint8_t *)peer, sizeof peer - 1, &peer_len));
    peer[peer_len] = 0;
    kvrail_set_log_level(KVRAIL_LOG_WARN);
    if (seen_registered < 2 || seen_handshake < 1) {
        fprintf(stderr, "log callback: %d registration and %d handshake lines\n", seen_registered, seen_handshake);
        return 1;
    }
    printf("log callback: %d registration lines and %d handshake line(s) at DEBUG\n", seen_registered, seen_handshake);

    /* READ three descriptors (one spanning most of the region) */
    kvrail_desc local[3] = {{dst, 0, 1}, {dst, 4096, 65536}, {dst, 100000, LEN - 100000}};
    kvrail_desc remote[3] = {{src, 0, 1}, {src, 4096, 65536}, {src, 100000, LEN - 100000}};
    kvrail_xfer *x = NULL;
    CHECK(kvrail_xfer_new(d, KVRAIL_OP_READ, local, 3, peer, remote, 3, (const uint8_t *)"read", 4, &x));
    CHECK(kvrail_xfer_post(x));
    CHECK(kvrail_xfer_wait(x, 120000));
    kvrail_xfer_state st = KVRAIL_XFER_STATE_FAILED;
    CHECK(kvrail_xfer_status(x, &st));
    if (st != KVRAIL_XFER_STATE_DONE) { fprintf(stderr, "status %u\n", (unsigned)st); return 1; }
    CHECK(kvrail_xfer_free(x));
    CHECK(kvrail_agent_read_region(d, dst, 0, back, LEN));
    for (size_t k = 0; k < 3; k++)
        for (uint64_t i = local[k].offset; i < local[k].offset + local[k].len; i++)
            if (back[i] != buf[i]) { fprintf(stderr, "READ: byte %llu differs\n", (unsigned long long)i); return 1; }
    for (uint64_t i = 1; i < 4096; i++)
        if (back[i] != 0) { fprintf(stderr, "READ: byte %llu outside the descriptors was written\n", (unsigned long long)i); return 1; }
    if (wait_notif(p, "decode-0", "read")) return 1;

    /* WRITE a new pattern back over all of prefill's region */
    for (size_t i = 0; i < LEN; i++) buf[i] = pattern(2, i);
    CHECK(kvrail_agent_write_region(d, dst, 0, buf, LEN));
    kvrail_desc all_l = {dst, 0, LEN}, all_r = {src, 0, LEN};
    CHECK(kvrail_xfer_new(d, KVRAIL_OP_WRITE, &all_l, 1, peer, &all_r, 1, (const uint8_t *)"written", 7, &x));
    CHECK(kvrail_xfer_post(x));
    /* the notification comes after every byte: check the bytes as soon as it is here */
    if (wait_notif(p, "decode-0", "written")) return 1;
    CHECK(kvrail_agent_read_region(p, src, 0, back, LEN));
    if (memcmp(back, buf, LEN)) { fprintf(stderr, "WRITE: bytes differ\n"); return 1; }
    CHECK(kvrail_xfer_wait(x, 120000));
    CHECK(kvrail_xfer_free(x));

    /* the counters moved: one READ and one WRITE done (the JSON snapshot and the
     * Prometheus text; a small buffer first, to learn the size) */
    size_t need = 0;
    kvrail_result r = kvrail_agent_metrics(d, NULL, 0, &need);
    if (r != KVRAIL_RESULT_BUFFER_TOO_SMALL) return fail("kvrail_agent_metrics(NULL)", r);
    char *m = malloc(1 << 20);
    size_t mlen = 0;
    CHECK(kvrail_agent_metrics(d, (uint8_t *)m, (1 << 20) - 1, &mlen));
    m[mlen] = 0;
    if (!strstr(m, "\"name\":\"kvrail_transfers_total\"")) { fprintf(stderr, "no transfers in %s\n", m); return 1; }
    CHECK(kvrail_agent_metrics_prometheus(d, (uint8_t *)m, (1 << 20) - 1, &mlen));
    m[mlen] = 0;
    if (!strstr(m, "kvrail_transfers_total{agent=\"decode-0\",op=\"read\",outcome=\"done\"} 1\n") ||
        !strstr(m, "kvrail_transfers_total{agent=\"decode-0\",op=\"write\",outcome=\"done\"} 1\n")) {
        fprintf(stderr, "the transfer counters did not move:\n%s", m);
        return 1;
    }
    printf("metrics: %zu bytes of Prometheus text, one READ and one WRITE counted\n", mlen);
    free(m);

    free(buf);
    free(back);
    kvrail_agent_free(d);
    kvrail_agent_free(p);
    printf("all bytes match (READ 3 descriptors, WRITE %u bytes)\n", LEN);
    return 0;
}
