/*
 * Checks that the header's version macros describe the library the program runs with:
 * MORI_TP_VERSION_MAJOR.MINOR.PATCH against mori_version(), MORI_TP_ABI_VERSION against
 * mori_abi_version(). Prints "version_check: ..." and exits 0 when both agree.
 */
#include "mori_tp.h"

#include <stdio.h>
#include <string.h>

#define MORI_TP_STRING(x) #x
#define MORI_TP_EXPAND(x) MORI_TP_STRING(x)

int main(void) {
    const char *header = MORI_TP_EXPAND(MORI_TP_VERSION_MAJOR) "." MORI_TP_EXPAND(
        MORI_TP_VERSION_MINOR) "." MORI_TP_EXPAND(MORI_TP_VERSION_PATCH);
    const char *library = mori_version();
    if (strcmp(header, library) != 0) {
        fprintf(stderr, "version_check: the header is version %s, the library %s\n", header,
                library);
        return 1;
    }
    if (mori_abi_version() != MORI_TP_ABI_VERSION) {
        fprintf(stderr, "version_check: the header is ABI %u, the library ABI %u\n",
                (unsigned)MORI_TP_ABI_VERSION, (unsigned)mori_abi_version());
        return 1;
    }
    printf("version_check: header and library are version %s, ABI %u\n", library,
           (unsigned)mori_abi_version());
    return 0;
}
