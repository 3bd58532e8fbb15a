/*
 * A staging pool's free space under AddressSanitizer: the library poisons it, so a stray write
 * into it is reported where it happens. Run with one argument (tests/c_api.rs runs each, built
 * with -fsanitize=address):
 *   inside     writes every byte of two adjacent live slots, then of one after the other is
 *              freed: no report ("pool_poison: inside: no report").
 *   past       writes 100 bytes past the end of a 64 KiB slot, into free space: ASan reports a
 *              use-after-poison and the program exits non-zero.
 *   freed      writes into a slot after freeing it: reported likewise.
 *   neighbour  writes 100 bytes past a slot into the next slot, which is live: not reported
 *              (slots are adjacent, with no red zone between them), as REFERENCE.md section 12
 *              says ("pool_poison: neighbour: no report").
 * A mode that should have been reported prints "pool_poison: <mode>: no report" and exits 0.
 */
#include "mori_tp.h"

#include <stdio.h>
#include <string.h>

static MoriTpSlot take(MoriTpPool pool, uint64_t size) {
    MoriTpSlot slot;
    if (mori_tp_pool_try_alloc(pool, size, &slot) != MORI_OK) {
        fprintf(stderr, "pool_poison: %s\n", mori_last_error_message());
        slot.address = NULL;
    }
    return slot;
}

int main(int argc, char **argv) {
    const char *mode = argc > 1 ? argv[1] : "inside";
    MoriTpPoolOptions options;
    MoriTpPool pool = 0;
    MoriTpSlot a, b;
    volatile unsigned char *bytes;
    options.capacity = 1u << 20;
    options.min_slot = 64u << 10;
    options.memory = MORI_TP_POOL_HOST;
    options.flags = 0;
    if (mori_tp_pool_create(&options, &pool) != MORI_OK) {
        fprintf(stderr, "pool_poison: %s\n", mori_last_error_message());
        return 2;
    }
    a = take(pool, 64u << 10);
    if (a.address == NULL) return 2;
    bytes = (volatile unsigned char *)a.address;
    if (strcmp(mode, "inside") == 0) {
        b = take(pool, 64u << 10);
        if (b.address == NULL) return 2;
        memset(a.address, 1, (size_t)a.size);
        memset(b.address, 2, (size_t)b.size);
        mori_tp_pool_free(pool, b.offset);
        memset(a.address, 3, (size_t)a.size);
        bytes[a.size - 1] = 4;
    } else if (strcmp(mode, "past") == 0) {
        bytes[a.size + 99] = 1; /* the free space after the only slot */
    } else if (strcmp(mode, "freed") == 0) {
        mori_tp_pool_free(pool, a.offset);
        bytes[10] = 1;
        a.address = NULL;
    } else if (strcmp(mode, "neighbour") == 0) {
        b = take(pool, 64u << 10);
        if (b.address == NULL) return 2;
        bytes[a.size + 99] = 1; /* inside b */
        mori_tp_pool_free(pool, b.offset);
    } else {
        fprintf(stderr, "pool_poison: unknown mode %s\n", mode);
        return 2;
    }
    if (a.address != NULL) mori_tp_pool_free(pool, a.offset);
    if (mori_tp_pool_destroy(pool) != MORI_OK) {
        fprintf(stderr, "pool_poison: %s\n", mori_last_error_message());
        return 2;
    }
    printf("pool_poison: %s: no report\n", mode);
    return 0;
}
