// Opens each file given with LibTorch's pickle loader (torch::pickle_load), the format Python's
// torch.load reads; exits 1 naming the first file that fails.
#include <torch/serialize.h>
#include <torch/torch.h>

#include <fstream>
#include <iostream>
#include <iterator>

int main(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::ifstream in(argv[i], std::ios::binary);
    const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), {});
    try {
      const c10::IValue v = torch::pickle_load(bytes);
      if (!v.isTensor()) throw std::runtime_error("not a tensor");
    } catch (const std::exception& e) {
      std::cerr << argv[i] << ": " << e.what() << "\n";
      return 1;
    }
  }
  std::cout << "pickle_load opened " << argc - 1 << " files\n";
  return 0;
}
