/* Links the plugin (plugin.cpp), not mori-tp, and calls it: the plugin carries the library. */
#include <stdio.h>

int mori_tp_plugin_check(void);

int main(void) {
    const int status = mori_tp_plugin_check();
    if (status != 0) {
        fprintf(stderr, "plugin_host: mori_tp_plugin_check returned %d\n", status);
        return 1;
    }
    printf("plugin_host: the plugin works\n");
    return 0;
}
