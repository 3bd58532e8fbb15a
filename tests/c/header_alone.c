/* The header must compile on its own, as C99 and as C++17, with every warning an error. */
#include "mori_tp.h"

int main(void) {
    return MORI_OK;
}
