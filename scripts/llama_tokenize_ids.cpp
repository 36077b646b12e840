// Token ids for stdin's text from llama.cpp's own tokenizer, as a JSON array:
// the independent reference for tests/fixtures/text/smollm2_tokens.json
// (see scripts/make_text_fixtures.py). Loads only the vocabulary.
//
//   g++ -O1 -std=c++17 scripts/llama_tokenize_ids.cpp -I LLAMA/include -I LLAMA/ggml/include \
//       LLAMA/build/src/libllama.a LLAMA/build/ggml/src/libggml.a \
//       LLAMA/build/ggml/src/libggml-cpu.a LLAMA/build/ggml/src/libggml-base.a \
//       -fopenmp -lpthread -ldl -o /tmp/llama_tokenize_ids
//   /tmp/llama_tokenize_ids MODEL.gguf [--no-special] < text
//
// add_special (BOS/EOS as the GGUF says) unless --no-special; special tokens
// written in the text are always parsed.
#include <cstdio>
#include <cstring>
#include <iostream>
#include <iterator>
#include <string>
#include <vector>

#include "llama.h"

static void quiet(ggml_log_level, const char *, void *) {}

int main(int argc, char **argv) {
    if (argc < 2) {
        std::fprintf(stderr, "usage: %s MODEL.gguf [--no-special] < text\n", argv[0]);
        return 2;
    }
    const bool add_special = !(argc > 2 && std::strcmp(argv[2], "--no-special") == 0);
    llama_log_set(quiet, nullptr);
    llama_backend_init();
    llama_model_params params = llama_model_default_params();
    params.vocab_only = true;
    llama_model *model = llama_model_load_from_file(argv[1], params);
    if (model == nullptr) {
        std::fprintf(stderr, "cannot load %s\n", argv[1]);
        return 1;
    }
    const llama_vocab *vocab = llama_model_get_vocab(model);
    std::string text((std::istreambuf_iterator<char>(std::cin)), std::istreambuf_iterator<char>());
    std::vector<llama_token> ids(text.size() + 8);
    int n = llama_tokenize(vocab, text.data(), (int32_t)text.size(), ids.data(), (int32_t)ids.size(),
                           add_special, true);
    if (n < 0) {
        ids.resize(-n);
        n = llama_tokenize(vocab, text.data(), (int32_t)text.size(), ids.data(), (int32_t)ids.size(),
                           add_special, true);
    }
    if (n < 0) {
        std::fprintf(stderr, "llama_tokenize failed: %d\n", n);
        return 1;
    }
    std::printf("[");
    for (int i = 0; i < n; i++) {
        std::printf(i ? ", %d" : "%d", ids[i]);
    }
    std::printf("]\n");
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
