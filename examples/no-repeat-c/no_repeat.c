// Example logits processor in C (wit-bindgen c): bans the row's previous token, so the same
// token never appears twice in a row. Build: examples/build.sh (see examples/README.md).
#include <stdlib.h>

#include "logits_processor_plugin.h"

// The per-request session resource: no state needed.
struct exports_mlxhost_plugin_logits_processor_session_t {
  int unused;
};

bool exports_mlxhost_plugin_logits_processor_static_session_create(
    exports_mlxhost_plugin_logits_processor_sampling_params_t *params,
    exports_mlxhost_plugin_logits_processor_own_session_t *ret,
    exports_mlxhost_plugin_logits_processor_plugin_error_t *err) {
  (void)err;
  // The parameters are ours to free.
  exports_mlxhost_plugin_logits_processor_sampling_params_free(params);
  exports_mlxhost_plugin_logits_processor_session_t *s = calloc(1, sizeof *s);
  *ret = exports_mlxhost_plugin_logits_processor_session_new(s);
  return true;
}

bool exports_mlxhost_plugin_logits_processor_method_session_process(
    exports_mlxhost_plugin_logits_processor_borrow_session_t self,
    exports_mlxhost_plugin_logits_processor_borrow_logits_t logits,
    exports_mlxhost_plugin_logits_processor_borrow_history_t history, uint32_t step,
    exports_mlxhost_plugin_logits_processor_plugin_error_t *err) {
  (void)self;
  (void)step;
  (void)err;
  uint32_t n = mlxhost_plugin_tensors_method_history_len(history);
  if (n > 0) {
    logits_processor_plugin_list_u32_t last;
    mlxhost_plugin_tensors_method_history_read(history, n - 1, n, &last);
    mlxhost_plugin_tensors_method_logits_ban(logits, &last);
    logits_processor_plugin_list_u32_free(&last);
  }
  // Borrowed handles must be released before returning.
  mlxhost_plugin_tensors_logits_drop_borrow(logits);
  mlxhost_plugin_tensors_history_drop_borrow(history);
  return true;
}

void exports_mlxhost_plugin_logits_processor_method_session_accept(
    exports_mlxhost_plugin_logits_processor_borrow_session_t self, uint32_t token,
    float raw_logprob, float sampled_logprob) {
  (void)self;
  (void)token;
  (void)raw_logprob;
  (void)sampled_logprob;
}

void exports_mlxhost_plugin_logits_processor_session_destructor(
    exports_mlxhost_plugin_logits_processor_session_t *rep) {
  free(rep);
}
