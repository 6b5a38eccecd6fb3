//! The stack a program's deepest chain of BPF-to-BPF calls takes, as
//! Linux 6.1's verifier counts it (`check_max_stack_depth`): each frame
//! rounded up to 32 bytes, at most 512 bytes in all. Newer kernels round
//! to 16 when the program is JIT-compiled, so a chain the host kernel
//! takes can still be refused on 6.1 (it was, at 544 bytes); this finds
//! out from the object, in a moment, what the kernel matrix finds out in
//! minutes.
//!
//! Read from the instructions as aya links them (`relocate_calls`):
//! subprograms start at the targets of calls, as the verifier splits them,
//! and a frame is the deepest stack slot its instructions address, through
//! `r10` or through a register set from `r10` (a helper's key on the
//! stack). The verifier counts only the slots of the paths it walks, so
//! this is at least what it counts.

use std::collections::{BTreeSet, HashSet};

use aya_obj::{Object, generated::bpf_insn};

/// What Linux 6.1 allows a chain of calls in all.
pub const MAX_STACK: u32 = 512;

/// A program's deepest chain: its frames, outermost first, each as 6.1
/// rounds it.
#[derive(Debug)]
pub struct Chain {
    pub program: String,
    pub frames: Vec<u32>,
}

impl Chain {
    pub fn total(&self) -> u32 {
        self.frames.iter().sum()
    }
}

const BPF_CLASS_LD: u8 = 0x00;
const BPF_CLASS_LDX: u8 = 0x01;
const BPF_CLASS_ST: u8 = 0x02;
const BPF_CLASS_STX: u8 = 0x03;
const BPF_CLASS_ALU: u8 = 0x04;
const BPF_CLASS_ALU64: u8 = 0x07;
const BPF_CALL: u8 = 0x85;
const BPF_PSEUDO_CALL: u8 = 1;
const BPF_MOV64_REG: u8 = 0xbf;
const BPF_MOV64_IMM: u8 = 0xb7;
const BPF_ADD64_IMM: u8 = 0x07;
const FRAME_POINTER: u8 = 10;

/// The deepest chain of every program of `object`, by program name.
pub fn deepest_chains(object: &[u8]) -> Result<Vec<Chain>, String> {
    let mut obj = Object::parse(object).map_err(|e| format!("parsing the object: {e}"))?;
    let text_sections: HashSet<usize> = obj.functions.keys().map(|(section, _)| *section).collect();
    obj.relocate_calls(&text_sections)
        .map_err(|e| format!("linking calls: {e}"))?;
    let mut chains = Vec::new();
    for (name, program) in &obj.programs {
        let function = obj
            .functions
            .get(&program.function_key())
            .ok_or_else(|| format!("{name}: no linked function"))?;
        let insns = &function.instructions;
        let starts = subprogram_starts(insns);
        let frames: Vec<Frame> = starts
            .iter()
            .enumerate()
            .map(|(i, &start)| {
                let end = starts.get(i + 1).copied().unwrap_or(insns.len());
                Frame::of(insns, start, end, &starts)
            })
            .collect();
        let mut path = Vec::new();
        let frames_of_chain = deepest(&frames, 0, &mut path)?;
        chains.push(Chain {
            program: name.clone(),
            frames: frames_of_chain,
        });
    }
    chains.sort_by(|a, b| a.program.cmp(&b.program));
    Ok(chains)
}

fn is_pseudo_call(insn: &bpf_insn) -> bool {
    insn.code == BPF_CALL && insn.src_reg() == BPF_PSEUDO_CALL
}

/// Instruction 0 and every call's target, in order.
fn subprogram_starts(insns: &[bpf_insn]) -> Vec<usize> {
    let mut starts = BTreeSet::from([0]);
    for (pc, insn) in insns.iter().enumerate() {
        if is_pseudo_call(insn) {
            starts.insert(call_target(pc, insn));
        }
    }
    starts.into_iter().collect()
}

fn call_target(pc: usize, insn: &bpf_insn) -> usize {
    (pc as i64 + 1 + i64::from(insn.imm)) as usize
}

/// One subprogram: its frame as 6.1 rounds it, and the subprograms it
/// calls (indices into the starts).
struct Frame {
    rounded: u32,
    callees: BTreeSet<usize>,
}

impl Frame {
    fn of(insns: &[bpf_insn], start: usize, end: usize, starts: &[usize]) -> Self {
        let mut depth: i64 = 0;
        let mut callees = BTreeSet::new();
        // Registers known to hold r10 plus an offset (a stack address).
        let mut stack_offset: [Option<i64>; 11] = [None; 11];
        for (pc, insn) in insns.iter().enumerate().take(end).skip(start) {
            let (dst, src) = (insn.dst_reg() as usize, insn.src_reg() as usize);
            let class = insn.code & 0x07;
            let off = i64::from(insn.off);
            match class {
                BPF_CLASS_LDX if src == FRAME_POINTER as usize => depth = depth.max(-off),
                BPF_CLASS_ST | BPF_CLASS_STX if dst == FRAME_POINTER as usize => {
                    depth = depth.max(-off)
                }
                _ => {}
            }
            if is_pseudo_call(insn) {
                let target = call_target(pc, insn);
                callees.insert(
                    starts
                        .binary_search(&target)
                        .expect("a call's target starts"),
                );
            }
            if dst > 10 {
                continue;
            }
            // Track r10 copies so a helper's argument on the stack counts.
            stack_offset[dst] = match insn.code {
                BPF_MOV64_REG if src <= 10 => {
                    if src == FRAME_POINTER as usize {
                        Some(0)
                    } else {
                        stack_offset[src]
                    }
                }
                BPF_ADD64_IMM => stack_offset[dst].map(|o| o + i64::from(insn.imm)),
                BPF_MOV64_IMM => None,
                // Any other write of the register: ALU (32 or 64 bits),
                // loads, the 64-bit immediate.
                _ if matches!(
                    class,
                    BPF_CLASS_LD | BPF_CLASS_LDX | BPF_CLASS_ALU | BPF_CLASS_ALU64
                ) =>
                {
                    None
                }
                _ if insn.code == BPF_CALL => None,
                _ => stack_offset[dst],
            };
            if let Some(offset) = stack_offset[dst] {
                depth = depth.max(-offset);
            }
            if insn.code == BPF_CALL {
                // r0-r5 are clobbered by any call.
                stack_offset[..6].fill(None);
            }
        }
        let depth = depth.max(1) as u32;
        Frame {
            rounded: depth.div_ceil(32) * 32,
            callees,
        }
    }
}

/// The deepest chain from subprogram `at`: its frames, outermost first.
fn deepest(frames: &[Frame], at: usize, path: &mut Vec<usize>) -> Result<Vec<u32>, String> {
    if path.contains(&at) {
        return Err(format!("recursion through subprogram {at}"));
    }
    path.push(at);
    let mut best = Vec::new();
    for &callee in &frames[at].callees {
        let chain = deepest(frames, callee, path)?;
        if chain.iter().sum::<u32>() > best.iter().sum::<u32>() {
            best = chain;
        }
    }
    path.pop();
    let mut chain = vec![frames[at].rounded];
    chain.extend(best);
    Ok(chain)
}
