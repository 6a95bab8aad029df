//! Compiles kernel modules with NVRTC into the kernel cache and reports the
//! time and CUBIN size of each: checks kernel edits without a GPU, and fills
//! a cache (`STEPGRAPH_KERNEL_CACHE`) to carry to a GPU machine.
//!
//!     cargo run --release -p stepgraph-cuda --example compile_kernels -- [--arch sm_90] [MODULE...]

use std::time::Instant;

fn main() {
    let mut arch = "sm_90".to_string();
    let mut modules = Vec::new();
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--arch" {
            arch = args.next().expect("--arch needs a value");
        } else {
            modules.push(a);
        }
    }
    if modules.is_empty() {
        modules = stepgraph_cuda::kernels::modules().map(String::from).collect();
    }
    let mut failed = false;
    for m in &modules {
        let t = Instant::now();
        match stepgraph_cuda::kernels::compile(m, &arch) {
            Ok(cubin) => println!("{m}: {} bytes in {:.1} s", cubin.len(), t.elapsed().as_secs_f64()),
            Err(e) => {
                eprintln!("{m}: {e}");
                failed = true;
            }
        }
    }
    if failed {
        std::process::exit(1);
    }
}
