/* The connector through the C ABI, as an engine drives it: a prefill engine (scheduler +
 * worker) computes KV for a request into its paged cache and finishes it; the decode engine
 * admits the request with P's transfer parameters; both step (build_connector_meta ->
 * start_load_kv -> get_finished -> update_connector_output) until D has the KV and P freed
 * its blocks; D checks every byte. The caches are the engines' own host memory
 * (kv_buffer_device "cpu"), registered in place with kvrail_worker_new_caches: P allocates
 * one buffer per layer, D one pooled buffer holding every layer at offsets; each engine
 * writes and checks its KV in its own memory. argv[1]: "pull" or "push"; argv[2] / argv[3]:
 * the agents' JSON configurations (decode on host A, prefill on host B). Then the next turn
 * (bidirectional_kv_xfer): D finishes its decode leg as completed, keeps its blocks, and P
 * reads them back for turn 2 (kvrail_scheduler_request_finished_as). */
#define _POSIX_C_SOURCE 199309L
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"

#define LAYERS 4
#define BLOCK_BYTES 2048
#define NBLOCKS 32
#define LAYER_BYTES (2 * NBLOCKS * BLOCK_BYTES)
#define GAP 4160 /* between D's pooled layers: a wrong base lands in the wrong bytes */

static uint8_t kv(int layer, int plane, int blk, size_t i) {
    return (uint8_t)(i * 31 + (size_t)layer * 7 + (size_t)plane * 3 + (size_t)blk * 11) ^ (uint8_t)(i >> 8);
}

static const char *NAMES[LAYERS] = {"model.layers.0", "model.layers.1", "model.layers.2",
                                    "model.layers.3"};

struct engine {
    kvrail_scheduler *s;
    kvrail_worker *w;
    uint8_t *mem[LAYERS];  /* the engine's own memory: where each layer's cache starts */
    uint8_t *alloc[LAYERS]; /* what to free */
};

/* `pooled`: one allocation for every layer (GAP bytes before each); else one per layer. */
static int engine_new(struct engine *e, const char *name, const char *role, const char *mode,
                      const char *agent_cfg, int pooled) {
    char kv_cfg[512], addr[64];
    snprintf(kv_cfg, sizeof kv_cfg,
             "{\"kv_connector\":\"Kvrail%sConnector\",\"kv_role\":\"%s\",\"kv_buffer_device\":\"cpu\","
             "\"kv_connector_extra_config\":{\"bidirectional_kv_xfer\":true,\"kv_recompute_threshold\":16}}",
             strcmp(mode, "push") ? "Pull" : "Push", role);
    const char *layout =
        "{\"layers\":[\"model.layers.0\",\"model.layers.1\",\"model.layers.2\",\"model.layers.3\"],"
        "\"num_blocks\":32,\"block_bytes\":2048,\"planes\":2,\"block_size\":16}";
    kvrail_kv_cache caches[LAYERS];
    uint64_t offsets[LAYERS];
    memset(caches, 0, sizeof caches);
    memset(e->alloc, 0, sizeof e->alloc);
    size_t n_caches = pooled ? 1 : LAYERS;
    if (pooled) {
        uint8_t *pool = calloc(1, LAYERS * (GAP + LAYER_BYTES));
        if (!pool) return 1;
        e->alloc[0] = pool;
        for (int l = 0; l < LAYERS; l++) {
            offsets[l] = GAP + (uint64_t)l * (GAP + LAYER_BYTES);
            e->mem[l] = pool + offsets[l];
        }
        caches[0] = (kvrail_kv_cache){
            .mem = {.addr = (uint64_t)(uintptr_t)pool, .len = LAYERS * (GAP + LAYER_BYTES),
                    .kind = KVRAIL_MEM_HOST, .device_id = -1, .dmabuf_fd = -1},
            .layers = NAMES, .n_layers = LAYERS, .offsets = offsets, .layer_len = LAYER_BYTES};
    } else {
        for (int l = 0; l < LAYERS; l++) {
            e->alloc[l] = e->mem[l] = calloc(1, LAYER_BYTES);
            if (!e->mem[l]) return 1;
            caches[l] = (kvrail_kv_cache){
                .mem = {.addr = (uint64_t)(uintptr_t)e->mem[l], .len = LAYER_BYTES,
                        .kind = KVRAIL_MEM_HOST, .device_id = -1, .dmabuf_fd = -1},
                .layers = &NAMES[l], .n_layers = 1, .offsets = NULL};
        }
    }
    CHECK(kvrail_worker_new_caches(name, agent_cfg, kv_cfg, layout, 0, 1, caches, n_caches, &e->w));
    kvrail_agent *a = NULL;
    CHECK(kvrail_worker_agent(e->w, &a));
    size_t n = 0;
    CHECK(kvrail_agent_side_channel_addr(a, (uint8_t *)addr, sizeof addr - 1, &n));
    addr[n] = 0;
    kvrail_agent_free(a);
    CHECK(kvrail_scheduler_new(kv_cfg, name, addr, 1, &e->s));
    return 0;
}

/* One engine step; `got` collects the finished JSON. */
static int step(struct engine *e, char *got, size_t cap) {
    uint8_t meta[65536];
    size_t n = 0;
    CHECK(kvrail_scheduler_build_connector_meta(e->s, meta, sizeof meta, &n));
    CHECK(kvrail_worker_start_load_kv(e->w, meta, n));
    CHECK(kvrail_worker_wait_for_layer_load(e->w, "model.layers.0"));
    CHECK(kvrail_worker_get_finished(e->w, (uint8_t *)got, cap - 1, &n));
    got[n] = 0;
    CHECK(kvrail_scheduler_update_connector_output(e->s, got));
    return 0;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "pull";
    const char *cfg_a = argc > 2 ? argv[2] : "{\"backend\":\"tcp\",\"listen\":\"127.0.0.1:0\"}";
    const char *cfg_b = argc > 3 ? argv[3] : cfg_a;
    struct engine p, d;
    if (engine_new(&p, "prefill-engine", "kv_producer", mode, cfg_b, 0)) return 1;
    if (engine_new(&d, "decode-engine", "kv_consumer", mode, cfg_a, 1)) return 1;

    /* P: prefill 50 tokens into blocks 3..6 of its own memory, then finish the request */
    uint64_t pblocks[4] = {3, 4, 5, 6}, dblocks[4] = {10, 11, 20, 21};
    for (int l = 0; l < LAYERS; l++)
        for (int pl = 0; pl < 2; pl++)
            for (int b = 0; b < 4; b++) {
                uint8_t *blk = p.mem[l] + ((uint64_t)pl * NBLOCKS + pblocks[b]) * BLOCK_BYTES;
                for (size_t i = 0; i < BLOCK_BYTES; i++) blk[i] = kv(l, pl, b, i);
            }
    bool delay = false;
    char params[1024];
    size_t plen = 0;
    CHECK(kvrail_scheduler_request_finished(p.s, "cmpl-c-0", 50, "{\"do_remote_decode\":true}",
                                            pblocks, 4, &delay, (uint8_t *)params, sizeof params - 1, &plen));
    params[plen] = 0;
    if (!delay) { fprintf(stderr, "P did not keep the blocks\n"); return 1; }

    /* D: the request arrives (heartbeats start), is admitted with P's parameters,
       allocated, received */
    bool tracked = false, pending = false;
    CHECK(kvrail_scheduler_on_new_request(d.s, "cmpl-c-0-d", 50, params, &tracked));
    if (!tracked) { fprintf(stderr, "D does not heartbeat for a remote prefill\n"); return 1; }
    CHECK(kvrail_scheduler_has_pending_push_work(p.s, &pending));
    /* both modes: the finished request waits for P's next step to reach its workers */
    if (!pending) { fprintf(stderr, "P has no pending work with a finished request (%s)\n", mode); return 1; }
    uint64_t ext = 0;
    bool async = false;
    CHECK(kvrail_scheduler_get_num_new_matched_tokens(d.s, "cmpl-c-0-d", 50, params, 0, &ext, &async));
    if (ext != 50 || !async) { fprintf(stderr, "matched %llu\n", (unsigned long long)ext); return 1; }
    CHECK(kvrail_scheduler_update_state_after_alloc(d.s, "cmpl-c-0-d", 50, params, dblocks, 4, ext));

    int sent = 0, recvd = 0;
    for (int i = 0; i < 60000 && !(sent && recvd); i++) {
        char fp[4096], fd[4096];
        if (step(&p, fp, sizeof fp) || step(&d, fd, sizeof fd)) return 1;
        if (strstr(fd, "\"failed_recving\":[\"")) { fprintf(stderr, "D failed: %s\n", fd); return 1; }
        sent |= strstr(fp, "\"sending\":[\"cmpl-c-0\"]") != NULL;
        recvd |= strstr(fd, "\"recving\":[\"cmpl-c-0-d\"]") != NULL;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    if (!(sent && recvd)) { fprintf(stderr, "no completion (sent %d, received %d)\n", sent, recvd); return 1; }
    CHECK(kvrail_scheduler_has_pending_push_work(p.s, &pending));
    if (pending) { fprintf(stderr, "P still has push work after D received\n"); return 1; }
    for (int l = 0; l < LAYERS; l++)
        for (int pl = 0; pl < 2; pl++)
            for (int b = 0; b < 4; b++) {
                const uint8_t *blk = d.mem[l] + ((uint64_t)pl * NBLOCKS + dblocks[b]) * BLOCK_BYTES;
                for (size_t i = 0; i < BLOCK_BYTES; i++)
                    if (blk[i] != kv(l, pl, b, i)) {
                        fprintf(stderr, "KV differs: layer %d plane %d block %d byte %zu\n", l, pl, b, i);
                        return 1;
                    }
            }

    /* Turn 2 (bidirectional_kv_xfer, seed 003): D's decode leg ran to its end with 58
       tokens in its blocks; D keeps them for decoder_kv_blocks_ttl and its parameters name
       them (kv_recompute_threshold 16: the default, 64, would compute 58 tokens instead). P's next turn (70 tokens) reads them back into blocks of its own, then computes
       the rest: blocks 7, 8, 9, 12 get D's bytes, block 13 (past D's tokens) is untouched. */
    char back[1024];
    CHECK(kvrail_scheduler_request_finished_as(d.s, "cmpl-c-0-d", 50, params, dblocks, 4, true, 58, &delay,
                                               (uint8_t *)back, sizeof back - 1, &plen));
    back[plen] = 0;
    if (!delay || !strstr(back, "\"remote_num_tokens\":58") || !strstr(back, "\"do_remote_decode\":true")) {
        fprintf(stderr, "D kept no blocks for the next turn: %s\n", back);
        return 1;
    }
    uint64_t pblocks2[5] = {7, 8, 9, 12, 13};
    CHECK(kvrail_scheduler_get_num_new_matched_tokens(p.s, "cmpl-c-1", 70, back, 0, &ext, &async));
    if (ext != 58 || !async) { fprintf(stderr, "P reads back %llu tokens\n", (unsigned long long)ext); return 1; }
    CHECK(kvrail_scheduler_update_state_after_alloc(p.s, "cmpl-c-1", 70, back, pblocks2, 5, ext));
    recvd = 0;
    for (int i = 0; i < 60000 && !recvd; i++) {
        char fp[4096], fd[4096];
        if (step(&d, fd, sizeof fd) || step(&p, fp, sizeof fp)) return 1;
        if (strstr(fp, "\"failed_recving\":[\"")) { fprintf(stderr, "P's read-back failed: %s\n", fp); return 1; }
        recvd = strstr(fp, "\"recving\":[\"cmpl-c-1\"]") != NULL;
        struct timespec ts = {0, 1000000};
        nanosleep(&ts, NULL);
    }
    if (!recvd) { fprintf(stderr, "P never read turn 1's KV back\n"); return 1; }
    for (int l = 0; l < LAYERS; l++)
        for (int pl = 0; pl < 2; pl++)
            for (int b = 0; b < 5; b++) {
                const uint8_t *blk = p.mem[l] + ((uint64_t)pl * NBLOCKS + pblocks2[b]) * BLOCK_BYTES;
                for (size_t i = 0; i < BLOCK_BYTES; i++)
                    if (blk[i] != (b < 4 ? kv(l, pl, b, i) : 0)) {
                        fprintf(stderr, "read back: layer %d plane %d block %d byte %zu\n", l, pl, b, i);
                        return 1;
                    }
            }
    struct engine *es[2] = {&d, &p};
    for (int i = 0; i < 2; i++) {
        kvrail_scheduler_free(es[i]->s);
        kvrail_worker_free(es[i]->w); /* deregisters the caches: now they may be freed */
        for (int l = 0; l < LAYERS; l++) free(es[i]->alloc[l]);
    }
    printf("connector (%s): KV of 4 layers x 2 planes x 4 blocks arrived byte for byte in the engines' own memory; P freed its blocks; "
           "turn 2 read them back from D byte for byte\n", mode);
    return 0;
}
