// A plugin: a shared object that links libmori_tp.a and exports one function of its own. Linked
// with --exclude-libs,libmori_tp.a (what mori_tp::static and mori_tp-static.pc add), it exports
// none of the library's symbols: neither the mori_* functions nor the Rust internals, which
// would otherwise interpose on another copy of mori-tp (or of the Rust standard library) in the
// same process. tests/c_api.rs and tests/install.rs read its dynamic symbols; plugin_host.c
// loads it and calls the function.
#include "mori_tp.hpp"

extern "C" __attribute__((visibility("default"))) int mori_tp_plugin_check(void) {
    auto pool = mori_tp::pool::create(std::nothrow, 1 << 20);
    if (!pool) return 1;
    auto slot = pool->try_alloc(std::nothrow, 100);
    if (!slot) return 2;
    return mori_tp::abi_compatible() && mori_tp::action_name(MORI_TP_ACTION_SEND) == "MORI_TP_ACTION_SEND" ? 0 : 3;
}
