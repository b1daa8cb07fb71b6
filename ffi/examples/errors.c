/* The C ABI's error handling: NULL handles and pointers, descriptors outside registered
 * memory, bad configuration keys, unknown peers and regions, small buffers; out-parameters
 * untouched on failure; messages for every code. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvrail.h"

static int failures = 0;

static void last(char *msg, size_t cap) {
    size_t n = 0;
    if (kvrail_last_error((uint8_t *)msg, cap - 1, &n) != KVRAIL_RESULT_OK) n = 0;
    msg[n] = 0;
}

static void expect(const char *what, kvrail_result got, kvrail_result want, const char *needle) {
    char msg[512];
    last(msg, sizeof msg);
    if (got != want || (needle && !strstr(msg, needle))) {
        fprintf(stderr, "FAIL %s: got %u (%s) want %u; last error \"%s\" (wanted \"%s\")\n", what,
                (unsigned)got, kvrail_result_message(got), (unsigned)want, msg, needle ? needle : "");
        failures++;
    } else {
        printf("ok   %s: %s%s%s\n", what, kvrail_result_message(got), needle ? " — " : "", needle ? msg : "");
    }
}

static int log_calls, log_backend;
static void on_log(uint32_t level, const char *target, const char *message, void *userdata) {
    (void)userdata;
    log_calls++;
    if (level == KVRAIL_LOG_INFO && strstr(target, "kvrail::agent") && strstr(message, "kvrail backend: tcp"))
        log_backend++;
}

int main(void) {
    const char *tcp = "{\"backend\":\"tcp\",\"listen\":\"127.0.0.1:0\"}";
    /* kvrail's log records reach the callback at the level asked for, and none at 0 */
    kvrail_set_log_level(0);
    kvrail_set_log_callback(on_log, NULL);
    kvrail_agent *silent = NULL;
    expect("agent, logging off", kvrail_agent_new("silent", tcp, &silent), KVRAIL_RESULT_OK, NULL);
    kvrail_agent_free(silent);
    if (log_calls != 0) { fprintf(stderr, "FAIL %d log records at level 0\n", log_calls); failures++; }
    kvrail_set_log_level(KVRAIL_LOG_INFO);
    kvrail_agent *chatty = NULL;
    expect("agent, logging info", kvrail_agent_new("chatty", tcp, &chatty), KVRAIL_RESULT_OK, NULL);
    kvrail_agent_free(chatty);
    if (log_backend != 1) { fprintf(stderr, "FAIL the backend choice was logged %d times\n", log_backend); failures++; }
    else printf("ok   log callback: the backend choice at INFO from kvrail::agent\n");
    kvrail_set_log_level(KVRAIL_LOG_WARN);
    if (!kvrail_version() || !strchr(kvrail_version(), '.')) { fprintf(stderr, "FAIL kvrail_version %s\n", kvrail_version()); failures++; }
    else printf("ok   kvrail_version: %s\n", kvrail_version());
    kvrail_agent *a = (kvrail_agent *)0x1;
    expect("NULL name", kvrail_agent_new(NULL, tcp, &a), KVRAIL_RESULT_NULL_PARAMETER, "name");
    if (a != (kvrail_agent *)0x1) { fprintf(stderr, "FAIL out written on failure\n"); failures++; }
    expect("unknown config key", kvrail_agent_new("x", "{\"bakend\":\"tcp\"}", &a), KVRAIL_RESULT_INVALID_CONFIG, "bakend");
    expect("bad backend value", kvrail_agent_new("x", "{\"backend\":\"ucx\"}", &a), KVRAIL_RESULT_INVALID_CONFIG, "backend");
    expect("bad metadata store", kvrail_agent_new("x", "{\"metadata_store\":\"redis://h:1\"}", &a), KVRAIL_RESULT_INVALID_CONFIG, "metadata_store");
    expect("unreachable metadata store", kvrail_agent_new("x", "{\"backend\":\"tcp\",\"listen\":\"127.0.0.1:0\",\"metadata_store\":\"etcd://127.0.0.1:1\"}", &a), KVRAIL_RESULT_CONNECTION, "etcd at http://127.0.0.1:1 is unreachable");
    expect("NULL out", kvrail_agent_new("x", tcp, NULL), KVRAIL_RESULT_NULL_PARAMETER, "out");

    uint32_t region = 77;
    expect("NULL agent", kvrail_agent_register(NULL, 4096, KVRAIL_ACCESS_READ, &region), KVRAIL_RESULT_NULL_PARAMETER, "agent");
    if (region != 77) { fprintf(stderr, "FAIL out_region written on failure\n"); failures++; }
    expect("NULL xfer post", kvrail_xfer_post(NULL), KVRAIL_RESULT_NULL_PARAMETER, "xfer");
    expect("NULL xfer free", kvrail_xfer_free(NULL), KVRAIL_RESULT_OK, NULL);
    kvrail_agent_free(NULL);

    kvrail_agent *p = NULL, *d = NULL;
    expect("prefill", kvrail_agent_new("prefill-0", tcp, &p), KVRAIL_RESULT_OK, NULL);
    expect("decode", kvrail_agent_new("decode-0", tcp, &d), KVRAIL_RESULT_OK, NULL);
    if (!p || !d) return 1;
    uint32_t src = 0, dst = 0;
    expect("register", kvrail_agent_register(p, 4096, KVRAIL_ACCESS_READ, &src), KVRAIL_RESULT_OK, NULL);
    expect("register", kvrail_agent_register(d, 4096, KVRAIL_ACCESS_NONE, &dst), KVRAIL_RESULT_OK, NULL);
    expect("bad access bits", kvrail_agent_register(d, 4096, 8, &region), KVRAIL_RESULT_INVALID_ARGUMENT, "access");
    expect("zero bytes", kvrail_agent_register(d, 0, 0, &region), KVRAIL_RESULT_UNSUPPORTED, "0 bytes");
    uint8_t byte = 1;
    expect("write outside", kvrail_agent_write_region(d, dst, 4096, &byte, 1), KVRAIL_RESULT_OUT_OF_RANGE, "4096");
    expect("no region", kvrail_agent_deregister(d, 999), KVRAIL_RESULT_NO_REGION, "999");
    /* a huge length is out of range, checked before anything is allocated (it aborted) */
    expect("read huge", kvrail_agent_read_region(d, dst, 0, &byte, SIZE_MAX), KVRAIL_RESULT_OUT_OF_RANGE, "outside region");
    expect("read past the end", kvrail_agent_read_region(d, dst, 4000, &byte, 97), KVRAIL_RESULT_OUT_OF_RANGE, "4000");

    /* the caller's own memory */
    static uint8_t mine[8192];
    kvrail_mem_desc md = {.addr = (uint64_t)(uintptr_t)mine, .len = sizeof mine,
                          .kind = KVRAIL_MEM_HOST, .device_id = -1, .dmabuf_fd = -1};
    uint32_t own = 0;
    expect("register memory: NULL desc", kvrail_agent_register_memory(d, NULL, 0, &region), KVRAIL_RESULT_NULL_PARAMETER, "desc");
    expect("register memory", kvrail_agent_register_memory(d, &md, KVRAIL_ACCESS_WRITE, &own), KVRAIL_RESULT_OK, NULL);
    kvrail_mem_desc bad = md;
    bad.addr += 4096;
    bad.len = 16;
    expect("register memory: overlap", kvrail_agent_register_memory(d, &bad, 0, &region), KVRAIL_RESULT_INVALID_MEMORY, "overlaps region");
    bad = md;
    bad.addr = 0;
    expect("register memory: NULL addr", kvrail_agent_register_memory(d, &bad, 0, &region), KVRAIL_RESULT_INVALID_ARGUMENT, "addr");
    bad = md;
    bad.len = 0;
    expect("register memory: zero len", kvrail_agent_register_memory(d, &bad, 0, &region), KVRAIL_RESULT_INVALID_ARGUMENT, "len");
    bad = md;
    bad.kind = 9;
    expect("register memory: unknown kind", kvrail_agent_register_memory(d, &bad, 0, &region), KVRAIL_RESULT_INVALID_ARGUMENT, "kind: 9");
    bad = md;
    bad.kind = KVRAIL_MEM_DMABUF;
    expect("register memory: dma-buf without fd", kvrail_agent_register_memory(d, &bad, 0, &region), KVRAIL_RESULT_INVALID_ARGUMENT, "dmabuf_fd");
    bad.dmabuf_fd = 0;
    expect("register memory: dma-buf", kvrail_agent_register_memory(d, &bad, 0, &region), KVRAIL_RESULT_UNSUPPORTED, "KVRAIL_MEM_DMABUF");
    bad = md;
    bad.kind = KVRAIL_MEM_NPU;
    bad.device_id = 0;
    expect("register memory: NPU address outside every allocation", kvrail_agent_register_memory(d, &bad, 0, &region), KVRAIL_RESULT_INVALID_MEMORY, "outside every allocation of device 0");
    if (region != 77) { fprintf(stderr, "FAIL out_region written on failure\n"); failures++; }
    expect("deregister memory", kvrail_agent_deregister(d, own), KVRAIL_RESULT_OK, NULL);

    char addr[64], tiny[4], peer[64];
    size_t n = 12345;
    expect("small buffer", kvrail_agent_side_channel_addr(p, (uint8_t *)tiny, sizeof tiny, &n), KVRAIL_RESULT_BUFFER_TOO_SMALL, "needed");
    if (n != 12345) { fprintf(stderr, "FAIL out_len written on failure\n"); failures++; }
    expect("addr", kvrail_agent_side_channel_addr(p, (uint8_t *)addr, sizeof addr - 1, &n), KVRAIL_RESULT_OK, NULL);
    addr[n] = 0;
    expect("bad address", kvrail_agent_load_remote(d, "not an address", (uint8_t *)peer, sizeof peer, &n), KVRAIL_RESULT_INVALID_ARGUMENT, "not an address");
    expect("load", kvrail_agent_load_remote(d, addr, (uint8_t *)peer, sizeof peer - 1, &n), KVRAIL_RESULT_OK, NULL);
    expect("load by name without a metadata store", kvrail_agent_load_by_name(d, "prefill-0", (uint8_t *)tiny, sizeof tiny, &n), KVRAIL_RESULT_UNSUPPORTED, "no metadata_store configured");
    peer[n] = 0;
    /* the compatibility hash covers what the config says about the model, also from C */
    kvrail_agent *o = NULL;
    expect("agent of another model", kvrail_agent_new("decode-other", "{\"backend\":\"tcp\",\"listen\":\"127.0.0.1:0\",\"model\":\"llama-3-8b\",\"dtype\":\"bfloat16\",\"attn_backend\":\"flash\",\"draft_model\":\"eagle\"}", &o), KVRAIL_RESULT_OK, NULL);
    if (o) {
        size_t m = 0;
        char other[64];
        expect("another model: handshake refused", kvrail_agent_load_remote(o, addr, (uint8_t *)other, sizeof other, &m), KVRAIL_RESULT_HANDSHAKE, "compatibility hash mismatch");
        kvrail_agent_free(o);
    }
    expect("bad block_size", kvrail_agent_new("x", "{\"block_size\":0}", &a), KVRAIL_RESULT_INVALID_CONFIG, "block_size");

    kvrail_xfer *x = (kvrail_xfer *)0x1;
    kvrail_desc l[2] = {{dst, 0, 100}, {dst, 4000, 200}};
    kvrail_desc r[2] = {{src, 0, 100}, {src, 0, 200}};
    expect("local desc outside its region", kvrail_xfer_new(d, KVRAIL_OP_READ, l, 2, peer, r, 2, NULL, 0, &x), KVRAIL_RESULT_INVALID_DESC, "#1");
    if (x != (kvrail_xfer *)0x1) { fprintf(stderr, "FAIL xfer written on failure\n"); failures++; }
    kvrail_desc r_bad[1] = {{src, 4090, 100}};
    expect("remote desc outside", kvrail_xfer_new(d, KVRAIL_OP_READ, l, 1, peer, r_bad, 1, NULL, 0, &x), KVRAIL_RESULT_INVALID_DESC, "remote descriptor #0");
    kvrail_desc r_none[1] = {{4242, 0, 100}};
    expect("remote region unknown", kvrail_xfer_new(d, KVRAIL_OP_READ, l, 1, peer, r_none, 1, NULL, 0, &x), KVRAIL_RESULT_INVALID_DESC, "4242");
    expect("count mismatch", kvrail_xfer_new(d, KVRAIL_OP_READ, l, 2, peer, r, 1, NULL, 0, &x), KVRAIL_RESULT_LENGTH_MISMATCH, NULL);
    expect("bad op", kvrail_xfer_new(d, 7, l, 1, peer, r, 1, NULL, 0, &x), KVRAIL_RESULT_INVALID_ARGUMENT, "op 7");
    expect("NULL descriptors", kvrail_xfer_new(d, KVRAIL_OP_READ, NULL, 2, peer, r, 2, NULL, 0, &x), KVRAIL_RESULT_NULL_PARAMETER, "local");
    expect("unknown peer", kvrail_xfer_new(d, KVRAIL_OP_READ, l, 1, "nobody", r, 1, NULL, 0, &x), KVRAIL_RESULT_UNKNOWN_PEER, "nobody");
    expect("send to unknown peer", kvrail_agent_send_notif(d, "nobody", &byte, 1), KVRAIL_RESULT_UNKNOWN_PEER, NULL);
    /* a notification over the limit is refused (it was accepted, and the peer stopped reading) */
    size_t huge_len = ((size_t)4 << 20) + 1;
    uint8_t *huge = calloc(1, huge_len);
    expect("oversize notification", kvrail_agent_send_notif(d, peer, huge, huge_len), KVRAIL_RESULT_INVALID_ARGUMENT, "over the limit");
    free(huge);

    /* a good transfer; freeing it while in progress is refused, after completion accepted */
    expect("xfer", kvrail_xfer_new(d, KVRAIL_OP_READ, l, 1, peer, r, 1, NULL, 0, &x), KVRAIL_RESULT_OK, NULL);
    expect("wait before post", kvrail_xfer_wait(x, 10), KVRAIL_RESULT_INVALID_ARGUMENT, "never posted");
    expect("post", kvrail_xfer_post(x), KVRAIL_RESULT_OK, NULL);
    expect("wait", kvrail_xfer_wait(x, 60000), KVRAIL_RESULT_OK, NULL);
    expect("free", kvrail_xfer_free(x), KVRAIL_RESULT_OK, NULL);

    /* the connector */
    kvrail_scheduler *s = NULL;
    kvrail_worker *w = NULL;
    const char *pull = "{\"kv_connector\":\"KvrailPullConnector\",\"kv_role\":\"kv_both\"}";
    const char *layout = "{\"layers\":[\"l0\"],\"num_blocks\":4,\"block_bytes\":64,\"planes\":2,\"block_size\":16}";
    expect("kv config: unknown extra key", kvrail_scheduler_new("{\"kv_connector\":\"KvrailPullConnector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":{\"kv_lease\":3}}", "e", "127.0.0.1:1", 1, &s), KVRAIL_RESULT_INVALID_CONFIG, "kv_connector_extra_config.kv_lease");
    expect("kv config: bad buffer device", kvrail_scheduler_new("{\"kv_connector\":\"KvrailPullConnector\",\"kv_role\":\"kv_both\",\"kv_buffer_device\":\"cuda\"}", "e", "127.0.0.1:1", 1, &s), KVRAIL_RESULT_INVALID_CONFIG, "kv_buffer_device");
    expect("scheduler: bad address", kvrail_scheduler_new(pull, "e", "nowhere", 1, &s), KVRAIL_RESULT_INVALID_ARGUMENT, "side_channel_addr");
    expect("scheduler", kvrail_scheduler_new(pull, "e", "127.0.0.1:1", 1, &s), KVRAIL_RESULT_OK, NULL);
    uint64_t toks = 9;
    bool as = false;
    expect("bad params JSON", kvrail_scheduler_get_num_new_matched_tokens(s, "r", 10, "{\"tp_size\":\"x\"}", 0, &toks, &as), KVRAIL_RESULT_INVALID_ARGUMENT, "params_json");
    expect("NULL scheduler", kvrail_scheduler_get_num_new_matched_tokens(NULL, "r", 10, NULL, 0, &toks, &as), KVRAIL_RESULT_NULL_PARAMETER, "scheduler");
    expect("bad finished JSON", kvrail_scheduler_update_connector_output(s, "[]"), KVRAIL_RESULT_INVALID_ARGUMENT, "finished_json");
    expect("layout: unknown key", kvrail_worker_new("w", tcp, pull, "{\"layerz\":[]}", 1, &w), KVRAIL_RESULT_INVALID_CONFIG, "layout_json");
    /* layouts that cannot describe memory (they were accepted) */
    expect("layout: no layers", kvrail_worker_new("w", tcp, pull, "{\"layers\":[],\"num_blocks\":4,\"block_bytes\":64,\"planes\":2,\"block_size\":16}", 1, &w), KVRAIL_RESULT_INVALID_CONFIG, "layers: no layers");
    expect("layout: block_size 0", kvrail_worker_new("w", tcp, pull, "{\"layers\":[\"l0\"],\"num_blocks\":4,\"block_bytes\":64,\"planes\":2,\"block_size\":0}", 1, &w), KVRAIL_RESULT_INVALID_CONFIG, "block_size");
    expect("layout: kv_heads 0", kvrail_worker_new("w", tcp, pull, "{\"layers\":[\"l0\"],\"num_blocks\":4,\"block_bytes\":64,\"planes\":2,\"block_size\":16,\"kv_heads\":0}", 1, &w), KVRAIL_RESULT_INVALID_CONFIG, "kv_heads");
    expect("layout: overflow", kvrail_worker_new("w", tcp, pull, "{\"layers\":[\"l0\"],\"num_blocks\":9223372036854775807,\"block_bytes\":64,\"planes\":2,\"block_size\":16}", 1, &w), KVRAIL_RESULT_INVALID_CONFIG, "overflows");
    expect("worker: rank past the size", kvrail_worker_new_rank("w", tcp, pull, layout, 2, 2, &w), KVRAIL_RESULT_UNSUPPORTED, "tp rank 2");
    expect("rank ports: NULL with a count", kvrail_scheduler_set_rank_ports(s, NULL, 2), KVRAIL_RESULT_NULL_PARAMETER, "ports");
    uint16_t ports[2] = {5600, 5601};
    expect("rank ports", kvrail_scheduler_set_rank_ports(s, ports, 2), KVRAIL_RESULT_OK, NULL);
    uint64_t some[2] = {1, 2};
    expect("progress: NULL blocks", kvrail_scheduler_prefill_progress(s, "r", 40, NULL, NULL, 2, 16), KVRAIL_RESULT_NULL_PARAMETER, "blocks");
    expect("progress without push_stream: a no-op", kvrail_scheduler_prefill_progress(s, "r", 40, NULL, some, 2, 16), KVRAIL_RESULT_OK, NULL);
    /* the engine's own caches */
    static uint8_t cache_mem[2 * 4 * 64];
    const char *l0[1] = {"l0"};
    kvrail_kv_cache kc = {.mem = {.addr = (uint64_t)(uintptr_t)cache_mem, .len = sizeof cache_mem,
                                  .kind = KVRAIL_MEM_HOST, .device_id = -1, .dmabuf_fd = -1},
                          .layers = l0, .n_layers = 1, .offsets = NULL};
    expect("caches: host memory with kv_buffer_device rbln", kvrail_worker_new_caches("w", tcp, pull, layout, 0, 1, &kc, 1, &w), KVRAIL_RESULT_INVALID_MEMORY, "kv_buffer_device");
    const char *cpu = "{\"kv_connector\":\"KvrailPullConnector\",\"kv_role\":\"kv_both\",\"kv_buffer_device\":\"cpu\"}";
    kvrail_kv_cache nolayers = kc;
    nolayers.layers = NULL;
    expect("caches: NULL layer names", kvrail_worker_new_caches("w", tcp, cpu, layout, 0, 1, &nolayers, 1, &w), KVRAIL_RESULT_NULL_PARAMETER, "caches[0].layers");
    kvrail_kv_cache short_cache = kc;
    short_cache.mem.len = 100;
    expect("caches: smaller than the layout", kvrail_worker_new_caches("w", tcp, cpu, layout, 0, 1, &short_cache, 1, &w), KVRAIL_RESULT_INVALID_MEMORY, "l0: 100 bytes");
    expect("caches: the engine's memory", kvrail_worker_new_caches("w", tcp, cpu, layout, 0, 1, &kc, 1, &w), KVRAIL_RESULT_OK, NULL);
    kvrail_worker_free(w);
    expect("worker", kvrail_worker_new("w", tcp, pull, layout, 1, &w), KVRAIL_RESULT_OK, NULL);
    uint8_t junk[3] = {0xc1, 0x00, 0xff};
    expect("garbage metadata", kvrail_worker_start_load_kv(w, junk, 3), KVRAIL_RESULT_INVALID_ARGUMENT, "meta");
    expect("no such layer", kvrail_worker_region(w, 5, &region), KVRAIL_RESULT_INVALID_ARGUMENT, "layer_index");
    char tiny2[2];
    expect("finished: small buffer", kvrail_worker_get_finished(w, (uint8_t *)tiny2, sizeof tiny2, &n), KVRAIL_RESULT_BUFFER_TOO_SMALL, "needed");
    char fin[256];
    expect("finished: kept for the next call", kvrail_worker_get_finished(w, (uint8_t *)fin, sizeof fin - 1, &n), KVRAIL_RESULT_OK, NULL);
    kvrail_worker_free(w);
    kvrail_scheduler_free(s);

    for (unsigned c = 0; c < 1000; c++)
        if (!kvrail_result_message(c)) { fprintf(stderr, "FAIL NULL message for %u\n", c); failures++; }

    kvrail_agent_free(d);
    kvrail_agent_free(p);
    if (failures) { fprintf(stderr, "%d error check(s) failed\n", failures); return 1; }
    printf("all error checks passed\n");
    return 0;
}
